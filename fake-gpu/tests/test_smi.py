"""`fake-gpu smi -L`: the GPUs a container was given, from the device plugin's variable or the DRA driver's."""

from fake_gpu.smi import visible_uuids


def test_the_device_plugins_list_is_read_in_its_order():
    assert visible_uuids({"NVIDIA_VISIBLE_DEVICES": "GPU-b,GPU-a"}) == ["GPU-b", "GPU-a"]


def test_two_dra_claims_add_up_though_the_last_claims_list_won():
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-b", "GPU_AGENT_GPU_1": "GPU-b", "GPU_AGENT_GPU_0": "GPU-a",
           "GPU_AGENT_GPU_10": "GPU-k", "GPU_AGENT_CLAIM_0": "uid", "GPU_AGENT_GPU_X": "GPU-x"}
    assert visible_uuids(env) == ["GPU-b", "GPU-a", "GPU-k"]


def test_nothing_given_is_nothing_listed():
    assert visible_uuids({"NVIDIA_VISIBLE_DEVICES": "void"}) == []
