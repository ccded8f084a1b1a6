"""A declaration lacking a key its family's template reads is refused when it renders, naming the key."""

from tests.codegen.helpers import MYMOE, cli, snapshot, write_models


def test_a_config_without_the_attention_heads_is_refused_by_name_and_writes_nothing(capsys, tmp_path):
    # Selection never reads num_attention_heads, so the declaration loads; the template needs it.
    models = write_models(tmp_path / "models", mymoe=MYMOE.replace("num_attention_heads = 4\n", ""))
    out = tmp_path / "out"
    code, _, err = cli(capsys, "generate", "--models", str(models), "--model", "mymoe", "--out", str(out))
    assert code == 2
    assert err.strip() == (
        "error: model mymoe: [config] lacks num_attention_heads, which the mixtral template reads; add it"
    )
    assert snapshot(out) == {}
