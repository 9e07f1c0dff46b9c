#!/usr/bin/env bash
# Build the Linux installers into dist/: a .deb (installs under /opt/llamba, menu
# entry, llamba and llamba-cli on PATH) and a portable .tar.gz of the same folder.
#   packaging/build-linux.sh            # uses the current python; installs PyInstaller if missing
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VERSION=$($PY -c "import tomllib;print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])")
ARCH=$(dpkg --print-architecture 2>/dev/null || echo amd64)

$PY -m pip install -q -e '.[gui]' 'pyinstaller>=6.10'
rm -rf build/pyinstaller dist/pyinstaller dist/deb
$PY -m PyInstaller --noconfirm --log-level WARN packaging/llamba.spec \
    --distpath dist/pyinstaller --workpath build/pyinstaller

APPDIR=dist/pyinstaller/llamba
# portable archive: unpack anywhere, run ./llamba/llamba
tar -C dist/pyinstaller -czf "dist/llamba-$VERSION-linux-$ARCH.tar.gz" llamba

# .deb: the same folder under /opt/llamba
DEB=dist/deb
mkdir -p "$DEB/DEBIAN" "$DEB/opt" "$DEB/usr/bin" "$DEB/usr/share/applications" \
         "$DEB/usr/share/icons/hicolor/256x256/apps"
cp -a "$APPDIR" "$DEB/opt/llamba"
ln -s /opt/llamba/llamba "$DEB/usr/bin/llamba"
ln -s /opt/llamba/llamba-cli "$DEB/usr/bin/llamba-cli"
install -m 644 packaging/linux/llamba.desktop "$DEB/usr/share/applications/llamba.desktop"
install -m 644 packaging/llamba.png "$DEB/usr/share/icons/hicolor/256x256/apps/llamba.png"
SIZE_KB=$(du -sk "$DEB" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE_KB@/$SIZE_KB/" \
    packaging/linux/control.in > "$DEB/DEBIAN/control"
dpkg-deb --root-owner-group -Zgzip --build "$DEB" "dist/llamba_${VERSION}_${ARCH}.deb" >/dev/null
ls -la dist/*.deb dist/*.tar.gz
