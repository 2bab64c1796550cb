"""kubelet's registration socket in a device-plugin folder, for the daemon's tests: it records each plugin that
registers (`requests`) and says when the first has (`registered`)."""

import threading
from concurrent import futures

import grpc

from fake_gpu.deviceplugin import api_pb2, api_pb2_grpc


class Kubelet(api_pb2_grpc.RegistrationServicer):
    def __init__(self, folder):
        self.requests = []
        self.registered = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{folder / 'kubelet.sock'}")
        self.server.start()

    def Register(self, request, context):  # noqa: N802 - kubelet's gRPC method name
        self.requests.append(request)
        self.registered.set()
        return api_pb2.Empty()
