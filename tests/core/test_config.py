from dataclasses import dataclass

import pytest

from gradhub._config import config_or_options
from gradhub.train.strategies import make_strategy
from gradhub.train.strategies.allreduce import AllReduceConfig


@dataclass(kw_only=True)
class Settings:
    a: int = 1


def test_a_config_or_options_but_not_both() -> None:
    assert config_or_options(Settings, None, {"a": 2}) == Settings(a=2)
    given = Settings(a=3)
    assert config_or_options(Settings, given, {}) is given
    with pytest.raises(TypeError, match="not both"):
        config_or_options(Settings, given, {"a": 1})
    with pytest.raises(TypeError, match="'b'"):
        config_or_options(Settings, None, {"b": 1})
    # Every strategy takes its configuration this way.
    with pytest.raises(TypeError, match="not both"):
        make_strategy("allreduce", config=AllReduceConfig(), bucket_mb=1.0)
