"""The NVML source against a stand-in for the pynvml module (the real one is proven on a GPU
machine by scripts/gpu-check.sh)."""

from types import SimpleNamespace

from gpu_agent.mechanisms.inventory.nvml import NVMLSource


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"code {value}")
        self.value = value


class FakeNVML:
    NVMLError = NVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus=(), init_errors=()):
        self.gpus = list(gpus)
        self.init_errors = list(init_errors)
        self.inits = 0
        self.shutdowns = 0
        self.lost = False

    def nvmlInit(self):
        self.inits += 1
        if self.init_errors:
            raise NVMLError(self.init_errors.pop(0))

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if self.lost:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetName(self, h):
        return h["name"].encode()  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["mem"], free=h["mem"], used=0)

    def nvmlDeviceGetMigMode(self, h):
        if h.get("mig") is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return [h["mig"], h["mig"]]


H200 = {"uuid": "GPU-33964205-8823-9be7-440a-d72735a288f4", "name": "NVIDIA H200", "mem": 150754820096, "mig": 0}


def test_reads_count_uuid_name_memory_and_mig_mode():
    nvml = FakeNVML([H200, {**H200, "uuid": "GPU-2", "mig": 1}, {**H200, "uuid": "GPU-3", "mig": None}])
    r = NVMLSource(nvml).read()
    assert r.error is None and r.inventory.count == 3
    g = r.inventory.gpus[0]
    assert (g.uuid, g.name, g.memory_total_bytes, g.mig_mode) == (H200["uuid"], "NVIDIA H200", 150754820096, False)
    assert [g.mig_mode for g in r.inventory.gpus] == [False, True, False]


def test_library_not_found_and_driver_not_loaded_mean_zero_gpus_not_an_error():
    for code, words in ((12, "library not found"), (9, "driver not loaded")):
        r = NVMLSource(FakeNVML(init_errors=[code])).read()
        assert r.error is None and r.inventory.count == 0 and words in r.note


def test_other_errors_are_reported_distinctly():
    r = NVMLSource(FakeNVML(init_errors=[4])).read()
    assert r.inventory.count == 0 and "NVML error 4" in r.error


def test_a_driver_that_appears_late_is_picked_up():
    nvml = FakeNVML([H200], init_errors=[12, 9])
    src = NVMLSource(nvml)
    assert src.read().inventory.count == 0
    assert src.read().inventory.count == 0
    assert src.read().inventory.count == 1
    assert nvml.inits == 3
    src.read()
    assert nvml.inits == 3  # initialised once, then kept


def test_a_lost_gpu_stays_listed_as_lost_under_its_last_uuid_and_nvml_stays_initialised():
    nvml = FakeNVML([H200])
    src = NVMLSource(nvml)
    assert src.read().inventory.count == 1
    nvml.lost = True
    r = src.read()
    assert r.error is None and [(g.uuid, g.health) for g in r.inventory.gpus] == [(H200["uuid"], "Lost")]
    assert "GPU_IS_LOST" in r.inventory.gpus[0].health_reason and nvml.shutdowns == 0
    nvml.lost = False
    r = src.read()
    assert [(g.uuid, g.health) for g in r.inventory.gpus] == [(H200["uuid"], "Healthy")] and nvml.inits == 1


def test_other_errors_while_reading_are_errors_and_nvml_is_reinitialised():
    nvml = FakeNVML([H200])
    src = NVMLSource(nvml)
    assert src.read().inventory.count == 1
    nvml.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(NVMLError(999))
    r = src.read()
    assert "NVML error 999" in r.error and nvml.shutdowns == 1
    del nvml.nvmlDeviceGetMemoryInfo
    assert src.read().inventory.count == 1 and nvml.inits == 2


class FabricNVML(FakeNVML):
    """NVML whose GPUs report fabric info (as nvmlDeviceGetGpuFabricInfo does), or an error code."""

    NVML_ERROR_FUNCTION_NOT_FOUND = 13

    def nvmlDeviceGetGpuFabricInfo(self, h):
        fabric = h.get("fabric")
        if isinstance(fabric, int):
            raise NVMLError(fabric)
        return SimpleNamespace(**fabric)


RACK = bytes(range(16))


def gb200(i, state=3, status=0, cluster=RACK, clique=7):
    return {"uuid": f"GPU-00000000-0000-0000-0000-00000000000{i}", "name": "NVIDIA GB200", "mem": 1 << 37, "mig": 0,
            "fabric": {"state": state, "status": status, "clusterUuid": cluster, "cliqueId": clique}}


def reading_of(*gpus):
    return NVMLSource(FabricNVML(list(gpus))).read()


def test_the_clique_of_a_node_whose_gpus_agree_and_completed_registration():
    r = reading_of(gb200(0), gb200(1))
    assert r.inventory.clique == "00010203-0405-0607-0809-0a0b0c0d0e0f.7"
    assert r.inventory.fabric == "fabric completed: clique 00010203-0405-0607-0809-0a0b0c0d0e0f.7"


def test_no_clique_when_gpus_disagree_are_still_registering_failed_or_have_no_fabric():
    cases = [
        ((gb200(0), gb200(1, clique=8)), "GPUs disagree on their clique"),
        ((gb200(0), gb200(1, cluster=bytes(16))), "GPUs disagree on their clique"),
        ((gb200(0), gb200(1, state=2)), "fabric registration in progress on GPU(s) 1"),
        ((gb200(0, state=1), gb200(1, state=1)), "fabric registration not started on GPU(s) 0, 1"),
        ((gb200(0, status=5), gb200(1)), "fabric registration failed on GPU(s) 0 (NVML status 5)"),
        (({**H200, "fabric": {"state": 0, "status": 0, "clusterUuid": bytes(16), "cliqueId": 0}},),
         "fabric not supported (no multi-node NVLink)"),
        (({**H200, "fabric": FakeNVML.NVML_ERROR_NOT_SUPPORTED},), "fabric not supported (no multi-node NVLink)"),
        (({**H200, "fabric": FabricNVML.NVML_ERROR_FUNCTION_NOT_FOUND},), "fabric not supported (no multi-node NVLink)"),
    ]
    for gpus, reason in cases:
        r = reading_of(*gpus)
        assert r.error is None and r.inventory.count == len(gpus)
        assert r.inventory.clique == "" and r.inventory.fabric.startswith(reason), (gpus, r.inventory.fabric)


def test_a_binding_without_the_fabric_call_means_no_fabric_and_other_fabric_errors_are_errors():
    r = NVMLSource(FakeNVML([H200])).read()  # FakeNVML has no nvmlDeviceGetGpuFabricInfo
    assert r.inventory.clique == "" and r.inventory.fabric.startswith("fabric not supported")
    lost = reading_of({**H200, "fabric": FakeNVML.NVML_ERROR_GPU_IS_LOST})
    assert lost.error is None and [g.health for g in lost.inventory.gpus] == ["Lost"]
    broken = reading_of({**H200, "fabric": 999})
    assert broken.error is not None and "NVML error 999" in broken.error
