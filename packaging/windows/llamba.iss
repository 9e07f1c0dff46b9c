; Inno Setup script: wraps the PyInstaller folder (dist\pyinstaller\llamba) in a
; per-user installer that needs no administrator rights.
;   iscc /DAppVersion=0.1.0 packaging\windows\llamba.iss
#ifndef AppVersion
  #define AppVersion "0.0.0"
#endif
#define SrcDir "..\..\dist\pyinstaller\llamba"

[Setup]
AppId={{6B1F4C1E-9D8A-4E55-9C37-3B7C1A0F1A2D}
AppName=Llamba
AppVersion={#AppVersion}
AppPublisher=Llamba developers
DefaultDirName={autopf}\Llamba
DefaultGroupName=Llamba
; per-user install: {autopf} becomes %LOCALAPPDATA%\Programs, no UAC prompt
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
OutputDir=..\..\dist
OutputBaseFilename=llamba-{#AppVersion}-windows-x64-setup
SetupIconFile=..\llamba.ico
UninstallDisplayIcon={app}\llamba.exe
Compression=lzma2/max
SolidCompression=yes
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
WizardStyle=modern

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"

[Files]
Source: "{#SrcDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\Llamba"; Filename: "{app}\llamba.exe"
Name: "{group}\Llamba command line"; Filename: "{cmd}"; Parameters: "/k ""{app}\llamba-cli.exe"" --help"
Name: "{group}\Uninstall Llamba"; Filename: "{uninstallexe}"
Name: "{autodesktop}\Llamba"; Filename: "{app}\llamba.exe"; Tasks: desktopicon

[Run]
Filename: "{app}\llamba.exe"; Description: "{cm:LaunchProgram,Llamba}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; the program folder goes entirely, and so do the kernels Numba compiled for this
; PC; chats and downloaded models are the user's data and stay
Type: filesandordirs; Name: "{app}"
Type: filesandordirs; Name: "{localappdata}\llamba\llamba\Cache\numba"
