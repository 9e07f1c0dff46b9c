"""Draw Llamba's icon (a white lambda on a violet-to-blue rounded square) and
write packaging/llamba.png (256 px) and packaging/llamba.ico (16-256 px).
Run once after changing the design: python packaging/make_icon.py"""
import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
from PySide6.QtCore import QPointF, QRectF, Qt  # noqa: E402
from PySide6.QtGui import QColor, QFont, QGuiApplication, QImage, QLinearGradient, QPainter  # noqa: E402

HERE = Path(__file__).parent


def draw(size: int) -> QImage:
    img = QImage(size, size, QImage.Format_ARGB32)
    img.fill(Qt.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.Antialiasing)
    grad = QLinearGradient(QPointF(0, 0), QPointF(size, size))
    grad.setColorAt(0, QColor("#7c3aed"))
    grad.setColorAt(1, QColor("#2563eb"))
    p.setBrush(grad)
    p.setPen(Qt.NoPen)
    m = size * 0.04
    p.drawRoundedRect(QRectF(m, m, size - 2 * m, size - 2 * m), size * 0.22, size * 0.22)
    font = QFont("DejaVu Sans", max(6, int(size * 0.62)))
    font.setBold(True)
    p.setFont(font)
    p.setPen(QColor("white"))
    p.drawText(QRectF(0, -size * 0.04, size, size), Qt.AlignCenter, "λ")
    p.end()
    return img


def main() -> int:
    app = QGuiApplication(sys.argv[:1])  # noqa: F841 (fonts need an application)
    draw(256).save(str(HERE / "llamba.png"))
    # QImage writes one size per .ico; 256 px is what Windows scales from
    draw(256).save(str(HERE / "llamba.ico"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
