"""The sidecar's settings (`openalice-runner serve` fills them from its flags)."""

from __future__ import annotations

from dataclasses import dataclass

from openalice_runner.server.disclosure import SpeculationInfoLevel
from openalice_runner.server.release.modes import PASS, ReleaseMode, parse_release


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    turn_idle_timeout_s: float = 300.0
    max_open_turns: int = 4096
    watch_policy: bool = True
    request_timeout_s: float = 300.0  # caps the deadline a client asks for (server/deadline.py)
    max_tokens_limit: int = 32_768  # larger max_tokens are refused as absurd (400)
    providers_file: str | None = None  # watched and applied live when it validates (routing_watch.py)
    watch_interval_s: float = 1.0
    metrics_public: bool = False  # /metrics without the API key even when one is set
    metrics_max_age_s: float = 0.0  # > 0: scrapes within this long of a render reuse it
    # `serve --keys`: the keys file, one tenant per key (server/tenants/), watched and applied live when
    # it validates; `api_key` and it are exclusive (create_app refuses both)
    keys_file: str | None = None
    speculation_info: SpeculationInfoLevel = "full"  # what a reply's `speculation` shows (disclosure.py)
    # how a stream's tokens leave: pass, fixed:N or paced (server/release/); a string is parsed
    stream_release: ReleaseMode = PASS

    def __post_init__(self) -> None:
        self.stream_release = parse_release(self.stream_release)
