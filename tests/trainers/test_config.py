"""Tests of trainers.config: schema defaults, base inheritance, overrides, errors, reference."""

import copy
import dataclasses
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import yaml

from trainers.config import (
    SCHEMA,
    Config,
    ConfigError,
    Field,
    config_from_dict,
    load_config,
    reference_markdown,
    schema_keys,
)

# The keys the spec promises; a renamed or dropped key must fail here, not in a user's config.
EXPECTED_KEYS = """
experiment seed device inplace compile recompute precision conv2d conv_math threads
data.name data.batch_size data.eval_batch_size data.drop_last data.num_train data.num_test
data.image_size data.channels data.num_classes data.noise data.in_features data.out_features
data.test_fraction
data.root data.test_root data.x_name data.y_name data.labels data.augment
data.path data.vocab data.block_size data.val_fraction
model.name model.args
optim.name optim.lr optim.momentum optim.dampening optim.nesterov optim.weight_decay
optim.decay optim.betas optim.eps
schedule.name schedule.warmup_steps schedule.step_size schedule.milestones schedule.gamma schedule.min_lr
sample.tokens sample.prompt sample.temperature sample.top_k
train.epochs train.max_steps train.eval_every train.log_every train.grad_clip train.accumulate
logging.logdir logging.run_name logging.progress logging.timeline
checkpoint.dir checkpoint.every checkpoint.keep checkpoint.resume
distributed.bucket_mb distributed.backend distributed.sync_bn distributed.zero
""".split()


def write(path, text="experiment: default\n"):  # the default's value: a file of all defaults
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, "config errors must be one line"
    return msg


# --------------------------------------------------------------------------- defaults


def test_schema_has_exactly_the_promised_keys():
    assert schema_keys() == EXPECTED_KEYS


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_an_empty_file_is_an_error(tmp_path, text):
    msg = error_of(load_config, write(tmp_path / "empty.yaml", text))
    assert "empty.yaml is empty" in msg and "configs/*.yaml" in msg
    write(tmp_path / "child.yaml", "base: empty.yaml\nseed: 1\n")
    msg = error_of(load_config, tmp_path / "child.yaml")
    assert "empty.yaml (named by 'base:' in" in msg and "child.yaml" in msg


def test_defaults(tmp_path):
    cfg = load_config(write(tmp_path / "defaults.yaml"))
    assert cfg == config_from_dict({})
    expected = {
        "experiment": "default",
        "seed": 0,
        "device": "cpu",
        "inplace": "auto",
        "data.name": "digits",
        "data.batch_size": 64,
        "data.eval_batch_size": 512,
        "data.drop_last": True,
        "data.test_fraction": 0.2,
        "model.name": "mlp",
        "model.args": {},
        "optim.name": "sgd",
        "optim.lr": 0.1,
        "optim.momentum": 0.9,
        "optim.nesterov": False,
        "optim.betas": [0.9, 0.999],
        "optim.eps": 1e-8,
        "schedule.name": "none",
        "schedule.step_size": 1000,
        "schedule.milestones": [],
        "data.root": None,
        "data.augment": False,
        "train.epochs": 1,
        "train.max_steps": None,
        "train.eval_every": 100,
        "logging.logdir": "runs",
        "logging.run_name": None,
        "logging.timeline": True,
        "checkpoint.dir": "checkpoints",
        "checkpoint.every": 0,
        "checkpoint.keep": 2,
        "checkpoint.resume": False,
        "distributed.bucket_mb": 25.0,
        "distributed.backend": "auto",
        "distributed.sync_bn": False,
        "distributed.zero": 0,
        "train.accumulate": 1,
    }
    for key, value in expected.items():
        assert cfg[key] == value, key
        assert type(cfg[key]) is type(value), key


def test_every_default_passes_its_own_validation():
    defaults = config_from_dict({}).to_dict()
    assert config_from_dict(defaults) == config_from_dict({})


def test_attribute_access_and_plain_dict_args(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml", "model: {name: convnet, args: {width: 8}}\n"))
    assert isinstance(cfg.optim, Config)
    assert cfg.optim.lr == 0.1
    assert cfg.model.name == "convnet"
    assert type(cfg.model.args) is dict and cfg.model.args == {"width": 8}
    assert cfg["model.args"] is cfg.model.args
    with pytest.raises(AttributeError, match="did you mean 'optim.lr'"):
        _ = cfg.optim.lrr
    with pytest.raises(AttributeError, match="read-only"):
        cfg.optim.lr = 1.0
    with pytest.raises(KeyError):
        cfg["optim.nope"]


# --------------------------------------------------------------------------- base files


def test_base_chain_two_levels_with_relative_paths(tmp_path):
    write(
        tmp_path / "common" / "root.yaml",
        """
        seed: 1
        experiment: root
        optim: {name: adam, lr: 0.5, weight_decay: 0.1}
        data: {batch_size: 8}
    """,
    )
    write(
        tmp_path / "common" / "mid.yaml",
        """
        base: root.yaml
        experiment: mid
        optim: {lr: 0.25}
    """,
    )
    leaf = write(
        tmp_path / "exp" / "leaf.yaml",
        """
        base: ../common/mid.yaml
        optim: {lr: 0.125}
        data: {eval_batch_size: 16}
    """,
    )
    cfg = load_config(leaf)
    assert cfg.seed == 1  # from root
    assert cfg.experiment == "mid"  # mid over root
    assert cfg.optim.lr == 0.125  # leaf over mid over root
    assert cfg.optim.name == "adam"  # sections merge key by key
    assert cfg.optim.weight_decay == 0.1
    assert (cfg.data.batch_size, cfg.data.eval_batch_size) == (8, 16)


def test_base_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    msg = error_of(load_config, tmp_path / "a.yaml")
    assert "cycle" in msg and "a.yaml -> " in msg and "b.yaml" in msg
    assert msg.count(" -> ") == 2  # a -> b -> a: found on the first repeat
    write(tmp_path / "self.yaml", "base: self.yaml\n")
    assert "cycle" in error_of(load_config, tmp_path / "self.yaml")


def test_missing_base_names_the_including_file(tmp_path):
    child = write(tmp_path / "child.yaml", "base: nowhere.yaml\n")
    msg = error_of(load_config, child)
    assert "not found" in msg and "nowhere.yaml" in msg and "child.yaml" in msg


def test_bad_base_value(tmp_path):
    msg = error_of(load_config, write(tmp_path / "c.yaml", "base: [a.yaml]\n"))
    assert "base" in msg and "c.yaml" in msg


def test_model_args_deep_merge_and_lists_replace(tmp_path):
    write(
        tmp_path / "base.yaml",
        """
        model:
          name: resnet
          args: {hidden: [32, 32], act: relu, block: {depth: 2, width: 8}}
        optim: {betas: [0.5, 0.6]}
    """,
    )
    child = write(
        tmp_path / "child.yaml",
        """
        base: base.yaml
        model:
          args: {hidden: [64], block: {depth: 3}}
    """,
    )
    cfg = load_config(child)
    assert cfg.model.name == "resnet"
    assert cfg.model.args == {"hidden": [64], "act": "relu", "block": {"depth": 3, "width": 8}}
    assert cfg.optim.betas == [0.5, 0.6]


def test_a_file_that_names_another_model_replaces_its_bases_model_args(tmp_path):
    # As digits_convnet.yaml on quickstart.yaml: the MLP's arguments are not the conv net's.
    write(
        tmp_path / "base.yaml",
        """
        model: {name: mlp, args: {hidden: [256, 256], activation: relu}}
    """,
    )
    other = write(
        tmp_path / "other.yaml",
        """
        base: base.yaml
        model: {name: convnet, args: {channels: [32, 64]}}
    """,
    )
    assert load_config(other).model.args == {"channels": [32, 64]}
    bare = write(tmp_path / "bare.yaml", "base: base.yaml\nmodel: {name: resnet}\n")
    assert load_config(bare).model.args == {}
    same = write(tmp_path / "same.yaml", "base: base.yaml\nmodel: {name: mlp, args: {hidden: [8]}}\n")
    assert load_config(same).model.args == {"hidden": [8], "activation": "relu"}
    # A base without model.name names the default model.
    write(tmp_path / "nameless.yaml", "model: {args: {hidden: [4]}}\n")
    default = write(tmp_path / "d.yaml", "base: nameless.yaml\nmodel: {name: mlp}\n")
    assert load_config(default).model.args == {"hidden": [4]}
    # The rule is written down where users read it: the config reference.
    assert "replaced" in SCHEMA["model"]["args"].doc


def test_an_override_that_names_another_model_replaces_the_args_in_any_order(tmp_path):
    path = write(tmp_path / "c.yaml", "model: {name: mlp, args: {hidden: [8], activation: relu}}\n")
    for overrides in (
        ["model.name=convnet", "model.args.channels=[4]"],
        ["model.args.channels=[4]", "model.name=convnet"],
    ):
        cfg = load_config(path, overrides)
        assert (cfg.model.name, cfg.model.args) == ("convnet", {"channels": [4]})
    assert load_config(path, ["model.name=mlp", "model.args.hidden=[2]"]).model.args == {
        "hidden": [2],
        "activation": "relu",
    }


# --------------------------------------------------------------------------- overrides


def test_overrides_of_every_value_kind(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        """
        model: {args: {hidden: [8], act: relu}}
        train: {max_steps: 5}
    """,
    )
    cfg = load_config(
        path,
        [
            "optim.lr=0.05",
            "optim.eps=1e-6",  # YAML 1.1 would read this as a string
            "optim.momentum=1",  # ints are accepted for floats
            "optim.betas=[0.8, 0.9]",
            "train.max_steps=null",
            "optim.nesterov=true",
            "model.args.hidden=[64,64]",
            "model.args.norm.eps=1e-5",  # nested free-form key inside args
            "experiment=a=b",  # only the first '=' separates
            "logging.run_name=mine",
        ],
    )
    assert cfg.optim.lr == 0.05
    assert cfg.optim.eps == 1e-6
    assert cfg.optim.momentum == 1.0 and type(cfg.optim.momentum) is float
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.train.max_steps is None
    assert cfg.optim.nesterov is True
    assert cfg.model.args == {"hidden": [64, 64], "act": "relu", "norm": {"eps": 1e-5}}
    assert cfg.experiment == "a=b"
    assert cfg.logging.run_name == "mine"


def test_later_override_wins_and_sections_can_be_set_whole(tmp_path):
    path = write(tmp_path / "c.yaml")
    cfg = load_config(path, ["optim.lr=0.2", "optim={lr: 0.3, name: adamw}", "optim.lr=0.4"])
    assert (cfg.optim.lr, cfg.optim.name) == (0.4, "adamw")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("inplace: off\n", "off"),
        ("inplace: on\n", "on"),
        ("inplace: auto\n", "auto"),
        ("inplace: 'off'\n", "off"),
        ("inplace: false\n", "off"),
        ("inplace: true\n", "on"),
    ],
)
def test_inplace_bare_on_off_in_files(tmp_path, text, expected):
    assert load_config(write(tmp_path / "c.yaml", text)).inplace == expected


@pytest.mark.parametrize(
    "override, expected",
    [
        ("inplace=off", "off"),
        ("inplace=on", "on"),
        ("inplace=auto", "auto"),
        ("inplace=false", "off"),
    ],
)
def test_inplace_bare_on_off_in_overrides(tmp_path, override, expected):
    path = write(tmp_path / "c.yaml", "inplace: auto\n")
    assert load_config(path, [override]).inplace == expected


def test_resume_accepts_false_auto_path_and_true_means_auto(tmp_path):
    path = write(tmp_path / "c.yaml")
    assert load_config(path).checkpoint.resume is False
    assert load_config(path, ["checkpoint.resume=auto"]).checkpoint.resume == "auto"
    assert load_config(path, ["checkpoint.resume=ck/step_10.npz"]).checkpoint.resume == "ck/step_10.npz"
    assert load_config(path, ["checkpoint.resume=true"]).checkpoint.resume == "auto"


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_valid_devices(tmp_path, device):
    assert load_config(write(tmp_path / "c.yaml"), [f"device={device}"]).device == device


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "text, expected",
    [
        # unknown keys: sibling suggestion, suggestion across sections, list of valid keys
        ("optim: {lrr: 0.1}\n", ["unknown key 'optim.lrr'", "x.yaml", "did you mean 'optim.lr'?"]),
        ("train: {lr: 0.1}\n", ["unknown key 'train.lr'", "did you mean 'optim.lr'?"]),
        ("lr: 0.1\n", ["unknown key 'lr'", "did you mean 'optim.lr'?"]),
        ("optimizer: {lr: 0.1}\n", ["unknown key 'optimizer'", "did you mean 'optim'?"]),
        ("zzzz: 1\n", ["unknown key 'zzzz'", "valid keys: experiment, seed", "distributed"]),
        # wrong types
        ("optim: {lr: abc}\n", ["optim.lr must be a float, got 'abc' (str)", "x.yaml"]),
        ("data: {batch_size: true}\n", ["data.batch_size must be an int", "True (bool)"]),
        ("data: {batch_size: 64.0}\n", ["data.batch_size must be an int", "64.0 (float)"]),
        ("optim: {lr: true}\n", ["optim.lr must be a float", "(bool)"]),
        ("optim: {nesterov: 1}\n", ["optim.nesterov must be a bool", "1 (int)"]),
        ("optim: fast\n", ["optim is a section", "mapping", "'fast' (str)", "x.yaml"]),
        ("seed: {a: 1}\n", ["seed must be an int", "(dict)"]),
        ("model: {args: [1, 2]}\n", ["model.args must be a mapping", "(list)"]),
        ("optim: {betas: [0.9]}\n", ["optim.betas must be a list of 2 floats", "[0.9]"]),
        ("experiment: 2024\n", ["experiment must be a string", "quote"]),
        ("distributed: {backend: off}\n", ["distributed.backend must be a string", "quote"]),
        # bounds and choices
        ("optim: {lr: 0}\n", ["optim.lr must be > 0", "got 0.0", "x.yaml"]),
        ("data: {batch_size: 0}\n", ["data.batch_size must be >= 1", "got 0"]),
        ("data: {test_fraction: 1.0}\n", ["data.test_fraction must be > 0 and < 1"]),
        ("train: {max_steps: 0}\n", ["train.max_steps must be >= 1"]),
        ("optim: {betas: [0.9, 1.5]}\n", ["optim.betas must be >= 0 and < 1", "1.5"]),
        ("optim: {name: sgdd}\n", ["optim.name must be one of sgd, adam, adamw", "did you mean 'sgd'?"]),
        ("inplace: maybe\n", ["inplace must be one of off, auto, on", "'maybe'"]),
        ("device: gpu\n", ["device must be cpu, cuda or cuda:N", "'gpu'"]),
        ("device: 'cuda:'\n", ["device must be cpu, cuda or cuda:N"]),
        # file-level problems
        ("- a\n- b\n", ["top level of", "x.yaml", "must be a mapping", "list"]),
        ("optim: {lr: 0.1}\noptim: {lr: 0.2}\n", ["duplicate key 'optim'", "line 2", "x.yaml"]),
    ],
)
def test_file_errors(tmp_path, text, expected):
    msg = error_of(load_config, write(tmp_path / "x.yaml", text))
    for part in expected:
        assert part in msg, (part, msg)


def test_yaml_syntax_error_has_line_number(tmp_path):
    path = write(tmp_path / "x.yaml", "seed: 1\noptim:\n  lr: [0.1\ntrain: {}\n")
    msg = error_of(load_config, path)
    assert "YAML syntax error" in msg and "x.yaml" in msg and "line 4" in msg


def test_missing_file(tmp_path):
    msg = error_of(load_config, tmp_path / "nope.yaml")
    assert "not found" in msg and "nope.yaml" in msg


def test_error_in_base_names_the_base_file(tmp_path):
    write(tmp_path / "parent.yaml", "optim: {momentun: 0.5}\n")
    msg = error_of(load_config, write(tmp_path / "child.yaml", "base: parent.yaml\n"))
    assert "parent.yaml" in msg and "did you mean 'optim.momentum'?" in msg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lr", ["bad override 'optim.lr'", "KEY=VALUE"]),
        ("=3", ["bad override"]),
        ("optim..lr=3", ["bad override"]),
        ("optim.lrr=0.1", ["unknown key 'optim.lrr'", "override 'optim.lrr=0.1'", "did you mean 'optim.lr'?"]),
        ("batch_size=8", ["unknown key 'batch_size'", "did you mean 'data.batch_size'?"]),
        ("optim.lr=abc", ["optim.lr must be a float, got 'abc' (str)", "override 'optim.lr=abc'"]),
        ("optim.lr=-1", ["optim.lr must be > 0", "override"]),
        ("optim.lr.x=1", ["optim.lr is a value, not a section"]),
        ("optim.lr=[1", ["bad value in override 'optim.lr=[1'"]),
        ("inplace=sometimes", ["inplace must be one of off, auto, on"]),
        ("schedule.milestones=[48000, 32000]", ["schedule.milestones must be a list of increasing ints"]),
        ("schedule.milestones=[0, 32000]", ["every element of schedule.milestones must be >= 1", "got 0"]),
        ("schedule.milestones=32000", ["schedule.milestones must be a list of increasing ints", "32000 (int)"]),
        ("data.augment=yes please", ["data.augment must be a bool"]),
    ],
)
def test_override_errors(tmp_path, override, expected):
    msg = error_of(load_config, write(tmp_path / "c.yaml"), [override])
    for part in expected:
        assert part in msg, (part, msg)


def test_an_override_error_names_the_value_of_the_config_in_use(tmp_path):
    parent = write(tmp_path / "parent.yaml", "data: {batch_size: 32}\n")
    for path in (parent, write(tmp_path / "child.yaml", "base: parent.yaml\n")):
        msg = error_of(load_config, path, ["data.batch_size=abc"])
        assert msg.endswith("; the config in use has 32"), msg  # not the schema's default, 64
    msg = error_of(load_config, parent, ["optim.lr=abc"])  # a key the files leave alone: its default is in use
    assert msg.endswith("; the default is 0.1"), msg


def test_milestones_are_increasing_steps(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml"), ["schedule.name=multistep", "schedule.milestones=[32000, 48000]"])
    assert cfg.schedule.milestones == [32000, 48000]


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_config_from_dict_validates_and_names_its_source():
    msg = error_of(config_from_dict, {"optim": {"lrr": 0.1}}, source="checkpoint ck.npz")
    assert "unknown key 'optim.lrr'" in msg and "checkpoint ck.npz" in msg and "'optim.lr'" in msg
    assert "top level" in error_of(config_from_dict, ["not", "a", "dict"])
    assert config_from_dict({"inplace": False}).inplace == "off"


# --------------------------------------------------------------------------- serialization


def test_to_dict_round_trip_through_yaml_and_json(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        """
        inplace: off
        model: {name: mlp, args: {hidden: [16, 16], act: relu}}
        optim: {name: adam, lr: 3e-4}
        checkpoint: {resume: auto}
    """,
    )
    cfg = load_config(path, ["train.max_steps=7"])
    as_dict = cfg.to_dict()
    assert isinstance(as_dict["optim"], dict) and not isinstance(as_dict["optim"], Config)
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(as_dict))) == cfg
    # to_yaml must quote 'off', or reading it back would turn the policy into a bool
    again = load_config(write(tmp_path / "dumped.yaml", cfg.to_yaml()))
    assert again == cfg and again.inplace == "off"
    assert list(as_dict) == list(SCHEMA)  # schema order, so dumped configs read like the docs


def test_to_dict_is_a_copy_and_equality_is_by_value(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml", "model: {args: {hidden: [4]}}\n"))
    d = cfg.to_dict()
    d["model"]["args"]["hidden"].append(8)
    assert cfg.model.args == {"hidden": [4]}
    assert cfg != load_config(tmp_path / "c.yaml", ["optim.lr=0.3"])
    assert copy.deepcopy(cfg) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


# --------------------------------------------------------------------------- reference


def test_reference_markdown_lists_every_key_once():
    md = reference_markdown()
    lines = md.strip().splitlines()
    assert lines[0].startswith("| Key | Type | Default |")
    rows = lines[2:]
    assert [row.split("|")[1].strip().strip("`") for row in rows] == EXPECTED_KEYS
    for row in rows:  # an unescaped '|' in a doc would add a column and break the table
        assert row.replace("\\|", "").count("|") == 5, row
    optim_name = next(r for r in rows if r.startswith("| `optim.name`"))
    assert "`sgd`" in optim_name and "`adamw`" in optim_name
    assert "| `optim.lr` | float | `0.1` |" in md


def test_module_entry_point_prints_reference_without_heavy_imports():
    out = subprocess.run(
        [sys.executable, "-c", "import runpy, sys; runpy.run_module('trainers.config', run_name='__main__')"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference_markdown()
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, trainers.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('framework', 'models')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "[]"


def test_field_is_a_small_frozen_record():
    field = SCHEMA["optim"]["lr"]
    assert isinstance(field, Field) and field.default == 0.1 and field.gt == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        field.default = 1.0
