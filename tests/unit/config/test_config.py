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


def test_routing_comparators_take_a_flag_or_a_list_and_nothing_else():
    assert (load_job_config("iopfl_route", overrides={"iopfl": {"comparators": ["tent"]}})["iopfl"]["comparators"]
            == ["tent"])
    assert load_job_config("iopfl_route", overrides={"iopfl": {"comparators": False}})["iopfl"]["comparators"] is False
    with pytest.raises(ConfigError, match="iopfl.comparators"):
        load_job_config("iopfl_route", overrides={"iopfl": {"comparators": "tent"}})


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
    with pytest.raises(ConfigError, match=match):
        check_effective(load_job_config("fedsm", overrides={"fedsm": fedsm}))
    assert check_effective(load_job_config("fedsm",
                                           overrides={"fedsm": {"selector_steps": "batch", "selector_epochs": 3}}))


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
