"""The queue consumer against a scripted control plane: an item whose executor fails goes back
with its reason (the control plane counts the attempt and holds it back), and the consumer goes
straight on to the next item."""

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import Fence, WorkItem
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.mechanisms.queues.consumer import QueueConsumer


class ScriptedControlPlane:
    """Hands out `items` in order; records what comes back (the test asserts on these records)."""

    def __init__(self, items):
        self.items = list(items)
        self.released, self.acked = [], []

    def start_term(self, credential, holder):
        return Fence(holder, 1)

    def lease(self, credential, lease_seconds, wait_seconds, fence):
        return self.items.pop(0) if self.items else None

    def release(self, credential, item, error=None):
        self.released.append((item.idempotency_key, error))

    def ack(self, credential, item):
        self.acked.append(item.idempotency_key)

    def renew_lease(self, credential, item, lease_seconds):
        pass


class Executor:
    def __init__(self):
        self.ran = []

    def execute(self, item):
        self.ran.append(item.idempotency_key)
        if item.payload.get("poison"):
            raise RuntimeError("creating pod ns/gpu-work-poison failed: 422 Unprocessable Entity")
        return "executed"

    def after_ack(self, item):
        pass


def item(n, key, **payload):
    return WorkItem(n, key, payload, f"lease-{n}", 1)


async def test_a_failing_item_goes_back_with_its_reason_and_the_next_item_runs_at_once():
    control_plane = ScriptedControlPlane([item(1, "poison", poison=True), item(2, "good")])
    executor = Executor()
    metrics = AgentMetrics()

    async def refused():
        raise AssertionError("never refused here")

    clock = ManualClock()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), executor, clock,
                             HealthRegistry(clock, ["queues"]), metrics, 30.0, 1.0, refused)
    await consumer.set_open(True, "")
    assert await consumer.step() and await consumer.step()
    assert control_plane.released == [("poison", "creating pod ns/gpu-work-poison failed: 422 Unprocessable Entity")]
    assert control_plane.acked == ["good"] and executor.ran == ["poison", "good"]
    assert metrics.items.labels("failed")._value.get() == 1
