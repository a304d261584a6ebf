"""`kestrel router`: sglang_router's command line with kestrel's defaults, which the user's flags override."""

from kestrel.server.router import router_command


def test_defaults_fill_in_and_user_flags_win():
    command = router_command(["--worker-urls", "http://a", "http://b", "--host=0.0.0.0"])
    assert command[1:3] == ["-m", "sglang_router.launch_router"]
    args = command[3:]
    assert args[-4:] == ["--worker-urls", "http://a", "http://b", "--host=0.0.0.0"]
    assert "--host" not in args and args[args.index("--policy") + 1] == "cache_aware"
