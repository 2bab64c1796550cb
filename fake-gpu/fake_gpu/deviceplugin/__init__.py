"""The kubelet device-plugin API v1beta1: `api.proto` is copied from k8s.io/kubelet v0.36.2,
`api_pb2*.py` generated from it with grpcio-tools 1.85.1 (`make -C fake-gpu protos`)."""
