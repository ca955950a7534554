import re

import pytest

from pflseg.config import ConfigError, check_effective, job_names, load_job_config, merge, parse_set


def test_every_job_config_loads():
    names = job_names()
    assert {"fedavg", "fedprox", "fedbn", "local", "centralized"} <= set(names)
    for name in names:
        cfg = load_job_config(name)
        assert cfg["name"] == name


def test_unknown_key_is_an_error_naming_the_key(tmp_path):
    (tmp_path / "defaults.yaml").write_text("rounds: 2\ntrain:\n  lr: 0.1\n")
    (tmp_path / "bad.yaml").write_text("train:\n  lrr: 0.2\n")
    with pytest.raises(ConfigError, match=r"'train\.lrr'.*bad\.yaml|bad\.yaml.*'train\.lrr'"):
        load_job_config("bad", tmp_path)


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigError, match="rounds"):
        merge({"rounds": 3}, {"rounds": "three"}, "x.yaml")


def test_routing_comparators_are_a_list_of_names_and_nothing_else():
    from pflseg.flare.methods import method
    from pflseg.infer.routing import COMPARATORS

    assert load_job_config("iopfl_route")["iopfl"]["comparators"] == list(COMPARATORS)  # the default: every one
    assert (load_job_config("iopfl_route", overrides={"iopfl": {"comparators": ["tent"]}})["iopfl"]["comparators"]
            == ["tent"])
    assert load_job_config("iopfl_route", overrides={"iopfl": {"comparators": []}})["iopfl"]["comparators"] == []
    for bad in ("tent", False, [1], ["tnet"]):  # the type (config), the names (the method's check_config)
        with pytest.raises(ConfigError, match="iopfl.comparators"):
            method(load_job_config("iopfl_route", overrides={"iopfl": {"comparators": bad}}))


def test_int_is_accepted_for_float_and_override_wins():
    out = merge({"lr": 0.1, "n": 1}, {"lr": 1}, "x")
    assert out == {"lr": 1.0, "n": 1} and isinstance(out["lr"], float)


def test_bad_method_value():
    from pflseg.flare.methods import method

    cfg = load_job_config("fedavg")
    cfg["method"] = "fedsgd"
    with pytest.raises(ConfigError, match="fedsgd"):
        method(check_effective(cfg))


def test_parse_set_builds_nested_overrides():
    assert parse_set(["train.lr=0.5", "rounds=3"]) == {"train": {"lr": 0.5}, "rounds": 3}
    with pytest.raises(ConfigError):
        parse_set(["rounds"])


def test_cli_overrides_apply():
    cfg = load_job_config("fedprox", overrides={"fedprox": {"mu": 0.1}, "rounds": 2})
    assert cfg["fedprox"]["mu"] == 0.1 and cfg["rounds"] == 2


@pytest.mark.parametrize("fedsm, match", [
    ({"selector_fit": "fedaws"}, "fedsm.selector_fit"),
    ({"selector_input": "raw"}, "fedsm.selector_input"),
    ({"lda_shrinkage": 0.0}, "fedsm.lda_shrinkage"),
    ({"selector_steps": "epoch", "selector_epochs": 2}, "fedsm.selector_epochs=2 needs fedsm.selector_steps: batch"),
])
def test_fedsm_selector_options_are_checked(fedsm, match):
    from pflseg.flare.methods import method

    with pytest.raises(ConfigError, match=match):
        method(check_effective(load_job_config("fedsm", overrides={"fedsm": fedsm})))
    assert method(check_effective(load_job_config(
        "fedsm", overrides={"fedsm": {"selector_steps": "batch", "selector_epochs": 3}})))


@pytest.mark.parametrize("overrides, match", [
    ({"net": {"norm": "group"}}, r"net\.norm must be one of batch, instance, got 'group'"),
    ({"train": {"lr": -1}}, r"train\.lr must be a learning rate in \(0, 10\], got -1"),
    ({"train": {"lr": 0}}, r"train\.lr"),
    ({"train": {"lr": float("nan")}}, r"train\.lr"),
    ({"net": {"dropout": 1.5}}, r"net\.dropout"),
    ({"net": {"name": "resnet"}}, r"net\.name"),
    ({"net": {"num_res_units": 100}}, r"net\.num_res_units=100 exceeds the cap 8"),
])
def test_values_that_would_fail_inside_the_federation_fail_at_loading(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_job_config("fedavg", overrides=overrides)


def test_a_network_over_the_parameter_budget_is_refused_naming_its_keys():
    # each value inside its own cap, 821 M parameters together (counted on the meta device, nothing allocated)
    big = {"net": {"channels": [1024] * 8, "strides": [2] * 7, "num_res_units": 8}}
    with pytest.raises(ConfigError, match=r"net\.channels=.*net\.num_res_units=8.*821 M parameters.*budget of 200 M"):
        load_job_config("fedavg", overrides=big)
    assert load_job_config("lcfed")["net"]["name"] == "lcfed"  # LC-Fed's net is counted too, and fits


def test_size_batch_and_channels_are_bounded_jointly():
    with pytest.raises(ConfigError,
                       match=r"data\.size=1024 x train\.batch_size=1024 x net\.channels=.*GiB.*budget of 64"):
        load_job_config("fedavg", overrides={"data": {"size": 1024}, "train": {"batch_size": 1024}})
    with pytest.raises(ConfigError, match=r"train\.eval_batch_size=1024"):
        load_job_config("fedavg", overrides={"data": {"size": 1024}, "train": {"eval_batch_size": 1024}})
    load_job_config("fedavg", overrides={"data": {"size": 256}, "train": {"batch_size": 16}})  # a real setting fits


# ---- one method, one description: the common keys here, a method's own in its controller's check_config ---------
#: (job, override, what the error names): every method section, checked for every method that reads it
METHOD_RULES = [
    ("fedsm", {"fedsm": {"lam": 2.0}}, r"fedsm\.lam and fedsm\.gamma must lie in \[0, 1\], got 2\.0"),
    ("fedsm_infer", {"fedsm": {"lam": 2.0}}, r"fedsm\.lam"),
    ("fedsm_infer", {"fedsm": {"familiar_quantile": 1.5}}, r"fedsm\.familiar_quantile must lie in \(0, 1\]"),
    ("fedsm_infer", {"fedsm": {"mixing": "logits"}}, r"fedsm\.mixing"),
    ("fedsm", {"fedsm": {"selector": "resnet"}}, r"fedsm\.selector must be compact\|vgg11"),
    ("fedsm", {"fedsm": {"selector_lr": 0.0}}, r"fedsm\.selector_lr must be a learning rate in \(0, 10\], got 0\.0"),
    ("fedsm", {"fedsm": {"extra_rounds": 10**6}}, r"fedsm\.extra_rounds=1000000 exceeds the cap 10000 .*"
                                                  r"FedSMController\.ranges"),
    ("grace", {"grace": {"inner_lr": -1.0}}, r"grace\.inner_lr must be a learning rate"),
    ("grace", {"grace": {"eta_g": 11.0}}, r"grace\.eta_g must be a learning rate"),
    ("grace", {"grace": {"align": "kl"}}, r"grace\.align must be one of coral, mmd, adv, got 'kl'"),
    ("grace_server", {"grace": {"similarity": "cosine"}}, r"grace\.similarity must be one of total, split, reweight"),
    ("iopfl", {"iopfl": {"rule": "sgd"}}, r"iopfl\.rule must be one of ema, paper_eq4, got 'sgd'"),
    ("iopfl_route", {"iopfl": {"router": "x"}}, r"iopfl\.router must be one of paper, normalised, refcode"),
    ("iopfl_route", {"iopfl": {"rest": "x"}}, r"iopfl\.rest must be one of null, average, global, got 'x'"),
    ("iopfl_route", {"iopfl": {"tau": 1.5}}, r"iopfl\.tau must lie in \[0, 1\]"),
    ("iopfl_route", {"iopfl": {"epochs": 10**5}}, r"iopfl\.epochs=100000 exceeds the cap 1000"),
    ("lcfed", {"lcfed": {"contrast_on": "x"}}, r"lcfed\.contrast_on must be one of gate, gate_all, embedding"),
    ("fedrep", {"lcfed": {"nms_window": 4}}, r"lcfed\.nms_window and lcfed\.gauss_size must be odd"),
    ("fedrep", {"lcfed": {"gauss_size": 999}}, r"lcfed\.gauss_size=999 exceeds the cap 255"),
    ("fedprox", {"fedprox": {"mu": -0.1}}, r"fedprox\.mu must be >= 0, got -0\.1"),
    ("ft", {"ft": {"epochs": 10**5}}, r"ft\.epochs=100000 exceeds the cap 1000"),
]


@pytest.mark.parametrize("job, override, match", METHOD_RULES)
def test_a_method_section_is_checked_by_the_methods_that_read_it(job, override, match):
    from pflseg.flare.methods import method

    cfg = load_job_config(job, overrides=override)  # the common checks know nothing of the method's section
    with pytest.raises(ConfigError, match=match):
        method(cfg)
    with pytest.raises(ConfigError, match=match):  # the server's and the site's check of a received config
        method(check_effective(cfg), "job config sent by the server")
    assert method(load_job_config(job))  # the job's own values pass


def test_another_methods_section_is_not_this_methods_business():
    """A fedavg job never reads fedsm.lam: it does not fail on it (its run identity ignores it too)."""
    from pflseg.flare.methods import method

    assert method(load_job_config("fedavg", overrides={"fedsm": {"lam": 2.0}, "iopfl": {"epochs": 10**5}}))


def test_config_py_holds_no_method_section():
    from pflseg.config import RANGES, validate
    from pflseg.flare.methods import METHOD_SECTIONS

    assert not {key.split(".")[0] for key in RANGES} & METHOD_SECTIONS
    cfg = load_job_config("fedavg")
    for section in METHOD_SECTIONS:  # validate reads none of them
        cfg.pop(section, None)
    validate(cfg)


def test_a_bad_method_value_on_the_command_line_fails_naming_the_key(tmp_path, capsys):
    from pflseg.cli import main

    assert main(["jobs", "export", "fedsm", "--out", str(tmp_path), "--set", "fedsm.lam=2"]) == 2
    assert "fedsm.lam and fedsm.gamma must lie in [0, 1], got 2.0" in capsys.readouterr().err
    assert not (tmp_path / "fedsm").exists()


@pytest.mark.parametrize("job, override, match", [
    ("fedsm_infer", {"fedsm": {"lam": 2.0}}, r"server job config: fedsm\.lam"),  # a post-training controller
    ("iopfl_route", {"iopfl": {"router": "x"}}, r"server job config: iopfl\.router"),
    ("iopfl", {"iopfl": {"rule": "x"}}, r"server job config: iopfl\.rule"),  # a training one
])
def test_the_server_applies_the_methods_rules_to_the_job_it_is_given(job, override, match, tmp_path, monkeypatch):
    from pflseg.flare.methods import METHODS

    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    ctrl = METHODS[job].controller(config=load_job_config(job, overrides=override))  # a hand-edited job's config
    ctrl.sample_clients = lambda: ["site-1", "site-2"]
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    panics: list = []
    ctrl.panic = panics.append
    assert ctrl.setup() is None and len(panics) == 1
    assert re.search(match, panics[0])


def test_a_bad_override_is_named_as_the_override_not_as_the_job_file():
    """Before: `--set net.norm=group` read "app_configs/fedavg.yaml: net.norm must be one of ..." as if the file
    were wrong."""
    with pytest.raises(ConfigError) as err:
        load_job_config("fedavg", overrides={"net": {"norm": "group"}, "rounds": 1})
    text = str(err.value)
    assert text.startswith("command-line overrides (net.norm, rounds) of ")
    assert "fedavg.yaml: net.norm must be one of batch, instance, got 'group'" in text
