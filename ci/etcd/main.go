// etcd for the kind node image (ci/scripts/build-kind-node.sh): the server's own entry point from the Go
// module proxy, at the version kubeadm v1.36 deploys (its static Pod passes 3.6-only flags, such as
// --feature-gates=InitialCorruptCheck=true, which Debian's etcd 3.4 refuses). The etcd repository's root
// module has replace directives, so it cannot be built by `go install`; this main is its main.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
