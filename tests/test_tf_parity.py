"""TensorFlow and PyTorch at parity: the same ``stats()`` keys, and the same state in a checkpoint
under the same names (residuals, reference weights, counters); docs/tensorflow.md lists what
only one of them keeps."""
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("torch")

import horovod_sbc.tensorflow as hsbc_tf  # noqa: E402
import horovod_sbc.torch as hsbc_torch  # noqa: E402
from horovod_sbc.residual import COUNTER_KEYS  # noqa: E402


def test_stats_have_the_keys_of_torch():
    tf_stats = hsbc_tf.SBC(density=0.01).stats()
    torch_stats = hsbc_torch.SBC(density=0.01).stats()
    assert list(tf_stats) == list(torch_stats) == list(COUNTER_KEYS)
    assert set(tf_stats.values()) == set(torch_stats.values()) == {0}


def test_checkpoint_holds_the_state_of_torch_under_its_names(tmp_path):
    """``tf.train.Checkpoint(sbc=...)`` holds ``residuals/<name>``, ``reference/<name>`` and
    ``counters/<key>``: the keys of torch's ``SBC.state_dict()`` for the same state."""
    sbc = hsbc_tf.SBC(density=0.01, delay=2)
    w = tf.Variable(tf.ones([3, 4]), name="w")
    sbc._residual("w", (3, 4), tf.float32)  # what the first sync creates
    sbc._reference("w", w)
    path = tf.train.Checkpoint(sbc=sbc).write(str(tmp_path / "ckpt"))
    saved = {n.split("/.ATTRIBUTES")[0] for n, _ in tf.train.list_variables(path)}
    groups = {}
    for n in saved:
        parts = n.split("/")
        if parts[0] == "sbc":
            groups.setdefault(parts[1], set()).add("/".join(parts[2:]))
    torch_state = hsbc_torch.SBC(density=0.01).state_dict()
    for key in ("residuals", "reference", "counters"):
        assert key in torch_state and key in groups, (key, sorted(groups))
    assert groups["residuals"] == groups["reference"] == {"w"}
    assert groups["counters"] == set(torch_state["counters"]) == set(COUNTER_KEYS)
    # the rest: the delay window and the job's shape (torch: the optimizer state and "config")
    assert set(groups) - {"residuals", "reference", "counters"} <= {
        "local_steps", "pending", "world", "draws", "calls"}, sorted(groups)
