"""Where the processes of one multi-worker proxy meet: a private directory (0700) holding the
ipc sockets between the registry process and the HTTP workers, and the metrics they share."""

from __future__ import annotations

import os
from dataclasses import dataclass

METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it at import


@dataclass(frozen=True, slots=True)
class SharedPaths:
    directory: str

    @property
    def state_endpoint(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'state')}"

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'control')}"

    @property
    def work_endpoint(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'work')}"

    @property
    def admin_state(self) -> str:
        return os.path.join(self.directory, "admin-state")

    @property
    def metrics_dir(self) -> str:
        return os.path.join(self.directory, "metrics")
