// kstatus: what Flux (and `kubectl wait`-style tooling built on cli-utils) would say about live
// Kubernetes objects, computed by the very code they run: sigs.k8s.io/cli-utils pkg/kstatus/status.
//
// Reads JSON objects on stdin: one object, a list (`kind: List` or any `*List` with `items`, as
// `kubectl get -o json` or the API server return them), or a stream of either. Prints one JSON line
// per object, in input order:
//
//	{"apiVersion":..,"kind":..,"namespace":..,"name":..,"status":..,"message":..}
//
// status is one of kstatus' InProgress, Failed, Current, Terminating, NotFound, Unknown. When
// Compute itself fails (a malformed status, say), status is Unknown and "error" says why: the
// caller decides, the tool does not hide it. Bad JSON on stdin exits 1.
//
// Only the status package is linked (no client, no polling) so the binary stays small; the e2e
// suite fetches the objects itself and pipes them in (e2e/gitops.py).
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Namespace  string `json:"namespace"`
	Name       string `json:"name"`
	Status     string `json:"status"`
	Message    string `json:"message"`
	Error      string `json:"error,omitempty"`
}

// expand returns the objects a decoded value stands for: the value itself, or a list's items.
// Items of a typed list read straight from the API server (a DeploymentList) carry no apiVersion
// or kind; they take the list's apiVersion and its kind less "List", as kubectl does.
func expand(obj map[string]interface{}) []map[string]interface{} {
	kind, _ := obj["kind"].(string)
	items, isList := obj["items"].([]interface{})
	if !strings.HasSuffix(kind, "List") || !isList {
		return []map[string]interface{}{obj}
	}
	apiVersion, _ := obj["apiVersion"].(string)
	var out []map[string]interface{}
	for _, item := range items {
		m, ok := item.(map[string]interface{})
		if !ok {
			continue
		}
		if _, ok := m["kind"]; !ok && kind != "List" {
			m["kind"] = strings.TrimSuffix(kind, "List")
			if _, ok := m["apiVersion"]; !ok {
				m["apiVersion"] = apiVersion
			}
		}
		out = append(out, expand(m)...)
	}
	return out
}

func compute(obj map[string]interface{}) verdict {
	u := &unstructured.Unstructured{Object: obj}
	v := verdict{APIVersion: u.GetAPIVersion(), Kind: u.GetKind(), Namespace: u.GetNamespace(), Name: u.GetName()}
	res, err := status.Compute(u)
	if err != nil {
		v.Status, v.Error = string(status.UnknownStatus), err.Error()
		return v
	}
	v.Status, v.Message = string(res.Status), res.Message
	return v
}

func run(in io.Reader, out io.Writer) error {
	dec := json.NewDecoder(bufio.NewReader(in))
	enc := json.NewEncoder(out)
	for {
		var raw json.RawMessage
		if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return fmt.Errorf("reading stdin: %w", err)
		}
		// apimachinery's decoder, not encoding/json's: it keeps whole numbers int64, which is what
		// unstructured's accessors (metadata.generation, status.observedGeneration) expect; as
		// float64 Compute refuses every object that has a generation.
		var obj map[string]interface{}
		if err := utiljson.Unmarshal(raw, &obj); err != nil {
			return fmt.Errorf("decoding an object: %w", err)
		}
		if obj == nil {
			continue
		}
		for _, o := range expand(obj) {
			if err := enc.Encode(compute(o)); err != nil {
				return err
			}
		}
	}
}

func main() {
	out := bufio.NewWriter(os.Stdout)
	err := run(os.Stdin, out)
	if ferr := out.Flush(); err == nil {
		err = ferr
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kstatus:", err)
		os.Exit(1)
	}
}
