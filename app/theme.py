"""Light and dark looks.  "system" follows the desktop's colour scheme (and
switches live when it changes); the Fusion style makes both look the same on
every platform."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette

from . import markdown

_DARK = {
    QPalette.ColorRole.Window: "#1e1f24", QPalette.ColorRole.WindowText: "#e5e7eb",
    QPalette.ColorRole.Base: "#16171b", QPalette.ColorRole.AlternateBase: "#23252b",
    QPalette.ColorRole.Text: "#e5e7eb", QPalette.ColorRole.Button: "#2a2c33",
    QPalette.ColorRole.ButtonText: "#e5e7eb", QPalette.ColorRole.Highlight: "#3b82f6",
    QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: "#2a2c33",
    QPalette.ColorRole.ToolTipText: "#e5e7eb", QPalette.ColorRole.PlaceholderText: "#8b8f98",
    QPalette.ColorRole.Link: "#60a5fa", QPalette.ColorRole.Mid: "#3a3d45",
}
_LIGHT = {
    QPalette.ColorRole.Window: "#f7f7f8", QPalette.ColorRole.WindowText: "#111827",
    QPalette.ColorRole.Base: "#ffffff", QPalette.ColorRole.AlternateBase: "#f3f4f6",
    QPalette.ColorRole.Text: "#111827", QPalette.ColorRole.Button: "#eceef1",
    QPalette.ColorRole.ButtonText: "#111827", QPalette.ColorRole.Highlight: "#2563eb",
    QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: "#ffffff",
    QPalette.ColorRole.ToolTipText: "#111827", QPalette.ColorRole.PlaceholderText: "#9ca3af",
    QPalette.ColorRole.Link: "#2563eb", QPalette.ColorRole.Mid: "#d1d5db",
}

# per-look colours for the chat bubbles and the engine panel
BUBBLE = {
    "light": {"user": "#e8effd", "assistant": "#ffffff", "border": "#e5e7eb", "muted": "#6b7280",
              "accent": "#2563eb", "spark": "#2563eb"},
    "dark": {"user": "#24324d", "assistant": "#1b1c21", "border": "#30333b", "muted": "#9ca3af",
             "accent": "#60a5fa", "spark": "#60a5fa"},
}


def system_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    scheme = getattr(hints, "colorScheme", None)
    if scheme is not None:
        s = scheme()
        if s != Qt.ColorScheme.Unknown:
            return s == Qt.ColorScheme.Dark
    # older Qt or no desktop preference: judge by the default window colour
    return QGuiApplication.palette().color(QPalette.ColorRole.Window).lightness() < 128


def resolve(choice: str) -> str:
    if choice in ("light", "dark"):
        return choice
    return "dark" if system_is_dark() else "light"


def apply(app, look: str) -> None:
    """Apply 'light' or 'dark' to the whole application."""
    app.setStyle("Fusion")
    pal = QPalette()
    for role, colour in (_DARK if look == "dark" else _LIGHT).items():
        pal.setColor(role, QColor(colour))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text, QColor("#6b7280"))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.ButtonText, QColor("#6b7280"))
    app.setPalette(pal)


def markdown_palette(look: str) -> markdown.Palette:
    return markdown.DARK if look == "dark" else markdown.LIGHT
