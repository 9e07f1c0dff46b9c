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

    import PySide6
    from PySide6.QtWidgets import QApplication
    if PySide6.__version_info__[:3] == (6, 12, 0) and sys.version_info < (3, 12):
        print("warning: PySide6 6.12.0 loses references in Signal.emit on Python < 3.12 and can abort; "
              "pip install 'PySide6-Essentials!=6.12.0'", file=sys.stderr)

    from .window import MainWindow
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Llamba")
    app.setApplicationVersion(__version__)
    app.setDesktopFileName("llamba")
    win = MainWindow(model=args.model)
    if args.theme:
        win.apply_look(args.theme)
    win.show()
    code = app.exec()
    from .window import _THREADS
    for thread, _worker in _THREADS:        # a model still loading: let it end before Python does
        thread.wait(60_000)
    return code


if __name__ == "__main__":
    sys.exit(main())
