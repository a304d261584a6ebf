"""`kestrel router`: sglang_router's command line with kestrel's defaults, which the user's flags override.
`kestrel serve --dp-size 2`: two engine processes behind the router, which answers as a worker does; SIGTERM leaves
no process behind."""

import signal
import subprocess
import sys
import time

import httpx

from kestrel.server.dp import worker_args
from kestrel.server.router import router_command
from server_helpers import free_port


def test_defaults_fill_in_and_user_flags_win():
    command = router_command(["--worker-urls", "http://a", "http://b", "--host=0.0.0.0"])
    assert command[1:3] == ["-m", "sglang_router.launch_router"]
    args = command[3:]
    assert args[-4:] == ["--worker-urls", "http://a", "http://b", "--host=0.0.0.0"]
    assert "--host" not in args and args[args.index("--policy") + 1] == "cache_aware"


def test_prometheus_follows_the_routers_host_and_port():
    """sglang-router binds its metrics to 0.0.0.0:29000 whatever its own address: kestrel's default keeps them on the
    router's host, 1000 below its port, so two routers can run side by side; the user's flags still win."""
    def flags(args: list[str]) -> dict[str, str]:
        rest = router_command(args)[3:]
        return {flag: rest[rest.index(flag) + 1] for flag in ("--prometheus-host", "--prometheus-port") if flag in rest}
    assert flags([]) == {"--prometheus-host": "127.0.0.1", "--prometheus-port": "29000"}
    assert flags(["--port", "8000", "--host", "10.0.0.5"]) == {"--prometheus-host": "10.0.0.5",
                                                               "--prometheus-port": "7000"}
    assert flags(["--port=8100"])["--prometheus-port"] == "7100"
    assert flags(["--port", "80"])["--prometheus-port"] == "1080"
    assert flags(["--port", "8000", "--prometheus-port", "9100"]) == {"--prometheus-host": "127.0.0.1",
                                                                      "--prometheus-port": "9100"}


def test_workers_get_the_serve_flags_but_their_own_address():
    assert worker_args(["--dp-size", "2", "--port=9000", "--page-size", "4", "--host", "0.0.0.0"]) == \
        ["--page-size", "4"]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_dp_size_two_runs_workers_behind_the_router_and_stops_them_all():
    port = free_port()
    launcher = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--dp-size", "2", "--port", str(port),
                                 "--page-size", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, children = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.time() + 180
        while True:
            assert launcher.poll() is None and time.time() < deadline, "kestrel serve --dp-size 2 did not come up"
            try:
                if httpx.get(url + "/readiness", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        children = _children(launcher.pid)
        workers = [w["url"] for w in httpx.get(url + "/workers").json()["workers"]]
        assert len(children) == 3 and len(workers) == 2
        body = {"model": "k3.1-tiny", "prompt": "The king is", "max_tokens": 6, "temperature": 0}
        expected = httpx.post(workers[0] + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        for _ in range(2):
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.json()["choices"][0]["text"] == expected
    finally:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(90) == 0
    alive = [pid for pid in children if subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0]
    assert not alive
