"""`python -m app [MODEL]` or `llamba [MODEL]`: open the chat window."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    from . import __version__
    ap = argparse.ArgumentParser(prog="llamba", description="Llamba: chat with a local model")
    ap.add_argument("model", nargs="?", default=None,
                    help="a .gguf file or a catalog name (default: the last one used, else smollm2-135m)")
    ap.add_argument("--data-dir", default=None, help="where chats and settings live (also LLAMBA_DATA_DIR)")
    ap.add_argument("--theme", choices=["system", "light", "dark"], default=None)
    ap.add_argument("--version", action="version", version=f"llamba {__version__}")
    args = ap.parse_args(argv)
    if args.data_dir:
        os.environ["LLAMBA_DATA_DIR"] = args.data_dir

    from PySide6.QtWidgets import QApplication

    from .window import MainWindow
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Llamba")
    app.setApplicationVersion(__version__)
    app.setDesktopFileName("llamba")
    win = MainWindow(model=args.model)
    if args.theme:
        win.settings.theme = args.theme
        win.apply_look()
    win.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
