"""Settings the user chooses, persisted with QSettings (an INI file in the data dir)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from PySide6.QtCore import QSettings

from models.catalog import DEFAULT_MODEL

from .paths import settings_file

OVERFLOW_POLICIES = {       # runtime/context.py's policies
    "drop-turns": "Leave the oldest turns out of the prompt",
    "shift": "Shift the context (drop the oldest tokens, keep the system prompt)",
    "stop": "Stop and say the context is full",
}
DEVICES = {"auto": "Auto (GPU if available)", "cpu": "CPU", "cuda": "GPU (CUDA)"}
THEMES = {"system": "Follow the system", "light": "Light", "dark": "Dark"}
MAX_RECENT = 8


@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    recent_models: list = field(default_factory=list)
    device: str = "auto"
    gpu_layers: int = -1              # -1: all layers on the GPU
    cpu_moe: int = 0                  # experts of the first N layers in system memory (--n-cpu-moe); -1: all
    draft_model: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    max_tokens: int = 1024
    n_ctx: int = 4096
    overflow: str = "drop-turns"
    default_system: str = "You are a helpful assistant."
    json_schema: str = ""             # answers held to this JSON schema (runtime/constrain.py); empty: free text
    theme: str = "system"
    show_engine_panel: bool = True
    server_port: int = 8080           # the local server's port on 127.0.0.1 (0: any free port)

    def add_recent(self, model: str) -> None:
        self.recent_models = [model] + [m for m in self.recent_models if m != model]
        del self.recent_models[MAX_RECENT:]

    def engine_key(self) -> tuple:
        """What a change of forces the model to be loaded again."""
        return (self.model, self.device, self.gpu_layers, self.cpu_moe, self.n_ctx, self.draft_model, self.overflow)


def _qsettings() -> QSettings:
    return QSettings(str(settings_file()), QSettings.Format.IniFormat)


def load_settings() -> Settings:
    q = _qsettings()
    s = Settings()
    for f in fields(Settings):
        if not q.contains(f.name):
            continue
        raw = q.value(f.name)
        default = getattr(s, f.name)
        try:
            if isinstance(default, bool):
                value = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
            elif isinstance(default, list):
                value = [] if raw in (None, "") else ([raw] if isinstance(raw, str) else list(raw))
            else:
                value = type(default)(raw)
        except (TypeError, ValueError):
            continue                    # a hand-edited bad value falls back to the default
        setattr(s, f.name, value)
    if s.overflow not in OVERFLOW_POLICIES:
        s.overflow = Settings.overflow
    return s


def save_settings(s: Settings) -> None:
    q = _qsettings()
    for k, v in asdict(s).items():
        q.setValue(k, v)
    q.sync()
