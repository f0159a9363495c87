"""AppArgs (the Serve config's `args:`) names a few engine options for convenience but holds no
engine defaults: what it leaves out is EngineConfig's default, decided in cluster/config.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import EngineConfig
from deploy.app import AppArgs, engine_config_dict


def test_unset_engine_options_are_left_to_the_engine():
    args = AppArgs()
    assert engine_config_dict(args) == {"model": None, "actor_num_cpus": args.actor_num_cpus}
    assert args.num_worker_ranks == EngineConfig.default("tp_size") == 1
    assert args.engine_option("num_draft_tokens") is None  # resolved against the checkpoint
    assert args.engine_option("block_size_tokens") == EngineConfig.default("block_size_tokens")


def test_named_fields_and_the_engine_dict_are_one_set_of_options():
    named = AppArgs(tp_size=2, num_draft_tokens=0, engine={"max_num_seqs": 8})
    in_dict = AppArgs(engine={"tp_size": 2, "num_draft_tokens": 0, "max_num_seqs": 8})
    assert engine_config_dict(named) == engine_config_dict(in_dict)
    assert named.num_worker_ranks == in_dict.num_worker_ranks == 2
    EngineConfig.from_dict({**engine_config_dict(named), "model": "m"})  # all valid fields
    with pytest.raises(ValidationError, match="tp_size=2 contradicts engine.tp_size=4"):
        AppArgs(tp_size=2, engine={"tp_size": 4})
