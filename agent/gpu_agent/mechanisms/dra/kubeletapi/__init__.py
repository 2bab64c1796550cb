"""The kubelet's gRPC APIs a DRA driver serves: each `api.proto` copied unchanged from k8s.io/kubelet v0.36.2
(`pkg/apis/dra/v1`, `dra/v1beta1`, `pluginregistration/v1`, `dra-health/v1alpha1`), `api_pb2*.py` generated from
it with grpcio-tools 1.85.1 (`scripts/gen-dra-protos.sh`); regenerated, never edited. Each lives in a folder of its
own so that protobuf's descriptor pool registers four different file names (all four upstream files are `api.proto`)."""
