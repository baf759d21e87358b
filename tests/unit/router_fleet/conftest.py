"""Several routers behind one key: two real router processes sharing per-key limits through a real redis-server.

`RedisServer` is Debian's redis-server (scripts/redis-server.sh installs it) on a free loopback port,
with append-only persistence as the deployments run it, so a restart keeps the shared totals. The
routers are `python -m stack.router` processes over one real engine (role both, dummy:tiny), with a
keys file: each test uses its own key, so the module's routers serve every test.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.unit.router_front.conftest import MODEL, ServiceProcess, free_port
from tests.unit.router_pd.conftest import router_settings

LEASE_MS = 3000  # the shortest lease the config accepts: a killed router's slots come back within it
# Each test's own key: name → (env var, value, limits line of the keys file).
KEYS = {
    "rpm4": ("FLEET_RPM4_KEY", "fleet-key-rpm4-7f3a", "rpm = 4"),
    "one_at_a_time": ("FLEET_CONC_KEY", "fleet-key-conc-8e2b", "max_concurrent = 1"),
    "crash": ("FLEET_CRASH_KEY", "fleet-key-crash-9d1c", "max_concurrent = 1"),
    "quota": ("FLEET_QUOTA_KEY", "fleet-key-quota-6c4d", "token_quota = 60"),
    "outage": ("FLEET_OUTAGE_KEY", "fleet-key-outage-5b5e", ""),
}


class Engine(ServiceProcess):
    """`python -m stack.engine`, role both, dummy:small: slow enough (tens of ms a token on CPU) that a long
    generation keeps a request in flight while a test looks at the key's slots."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_addr = f"127.0.0.1:{self.health_port}"
        config = workdir / "engine.json"
        config.write_text(json.dumps({"model": MODEL, "role": "both", "checkpoint": "dummy:small", "kv_cache_bytes": 2e8,
                                      "kv_transfer_config": {"kv_port": 0}}))
        super().__init__("engine", ["stack.engine", "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port),
                                    "--health-port", str(self.health_port)], workdir / "engine.log", self.health_addr)


class RedisServer:
    """A real redis-server on a free loopback port, AOF on, data in `workdir`; `stop()` and `start()` again keep it."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        log = (self.workdir / "redis.log").open("a")
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                                         "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "no"],
                                        stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            assert self.process.poll() is None, f"redis-server exited: {(self.workdir / 'redis.log').read_text()[-1000:]}"
            try:
                if client.ping():
                    break
            except redis.RedisError:
                assert time.monotonic() < deadline, "redis-server did not answer PING within 20 s"
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


class RouterProcess(ServiceProcess):
    """`python -m stack.router` over `engine`, its own usage file, limits shared through `redis_url` (LIMITS_REDIS_URL)."""

    def __init__(self, workdir: Path, engine: Engine, redis_url: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        keys = "".join(f'[[keys]]\nname = "{name}"\nenv = "{env}"\n{limits}\n' for name, (env, _, limits) in KEYS.items())
        (workdir / "keys.toml").write_text(keys)
        settings = router_settings(workdir, "settings", engine, engine, MODEL,
                                   server=f"port = {self.port}\nhealth_port = {self.health_port}")
        settings.write_text(settings.read_text() + f"""
[auth]
keys_file = "keys.toml"
[limits_store]
lease_ms = {LEASE_MS}
timeout_ms = 500
""")
        env = {**os.environ, "PD_TEST_KEY": "fleet-default-key-0a0a", "LIMITS_REDIS_URL": redis_url,
               **{env: value for env, value, _ in KEYS.values()}}
        super().__init__("router", ["stack.router", "--config", str(settings)], workdir / "router.log",
                         f"127.0.0.1:{self.health_port}", env=env)

    def kill(self) -> None:
        """kill -9: no shutdown, no slot given back."""
        self.process.kill()
        self.process.wait()
        self.log.close()


@dataclass
class Fleet:
    engine: Engine
    redis: RedisServer
    routers: list[RouterProcess]
    workdir: Path


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name][1]}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("fleet")
    engine = Engine(workdir)
    started: list[ServiceProcess | RedisServer] = [engine]
    try:
        store = RedisServer(workdir)
        started.append(store)
        routers = [RouterProcess(workdir / f"router{i}", engine, store.url) for i in (1, 2)]
        started.extend(routers)
        yield Fleet(engine, store, routers, workdir)
    finally:
        for service in reversed(started):
            service.stop()
