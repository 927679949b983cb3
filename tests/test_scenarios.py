"""The named scenarios file: the shipped scenarios, and clear errors for malformed ones."""

import pytest

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.scenarios import load_scenarios, scenario


def test_shipped_scenarios_and_their_launch_flags():
    assert set(load_scenarios()) == {"homogeneous", "straggler", "two-speed", "interference", "network",
                                     "network-200", "network-300", "swapping-stragglers"}
    assert scenario("straggler").speed_factors(0.5) == (1.0, 1.0, 1.0, 3.0)
    interference = scenario("interference")
    assert interference.speed_factors(0.1) == (1.0,) * 4 and interference.speed_factors(0.5)[1] == 3.0
    assert [s.launch_flag(100) for s in interference.slowdowns] == ["1=3@33-67"]
    assert [s.launch_flag(100) for s in scenario("two-speed").slowdowns] == ["2=2", "3=2"]
    assert scenario("network").host_layout() == ([3, 1], {1: 100.0})


@pytest.mark.parametrize("body, named", [
    ("[a]\nworkers = 0", "workers"),
    ("[a]\nworkers = 100000000", "workers"),
    ("[a]\nworkers = 2\nspeed = 3", "speed"),
    ("[a]\nworkers = 2\nslowdown = [{ rank = 2, factor = 2.0 }]", "rank in 0..1"),
    ("[a]\nworkers = 2\nslowdown = [{ rank = 1, factor = 0.5 }]", "factor"),
    ("[a]\nworkers = 2\nslowdown = [{ rank = 1, factor = 1e308 }]", "factor"),
    ("[a]\nworkers = 2\nslowdown = [{ rank = 1, factor = 2.0, start = 0.6, end = 0.4 }]", "start < end"),
    ("[a]\nworkers = 2\nslowdown = [{ rank = 1, factor = 2.0, strat = 0.5 }]", "strat"),
    ("[a]\nworkers = 2\nslowdown = [{ rank = 1, factor = 2.0 }, { rank = 1, factor = 3.0 }]", "twice"),
    ("[a]\nworkers = 2\nlinks = [{ rank = 1, rate_mbit = -1.0 }]", "rate_mbit"),
    ("[a]\nworkers = 2\nlinks = [{ rank = 1, rate_mbit = 10.0 }, { rank = 1, rate_mbit = 20.0 }]", "twice"),
    ("[a\nworkers = 2", "not valid TOML"),
])
def test_malformed_scenarios_are_named(tmp_path, body, named):
    path = tmp_path / "s.toml"
    path.write_text(body)
    with pytest.raises(ConfigurationError, match=named):
        load_scenarios(path)


def test_unknown_scenario_lists_the_known_ones_and_binary_files_are_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="straggler"):
        scenario("nope")
    path = tmp_path / "s.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigurationError, match="UTF-8"):
        load_scenarios(path)
