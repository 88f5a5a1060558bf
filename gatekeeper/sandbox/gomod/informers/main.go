// Command informers starts one client-go Secrets informer per tenant identity, waits until every one has synced
// (or the timeout passes), prints one JSON line per informer and exits. It is the load generator of the seeds'
// storm as today's controllers send it: since client-go 1.35 a reflector syncs with a streaming watch-list
// (watch=1&sendInitialEvents=true) unless KUBE_FEATURE_WatchListClient=false makes it LIST as before.
//
// Each informer has its own client (its own TLS identity and connection), as separate controllers do. Every
// response is counted by kind (watch-list, watch, list) and status, so a test can see what the reflector sent and
// that a 429 was retried rather than answered with a LIST.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

var clientGoVersion = "unknown"

// identity is one tenant: a client certificate and key, or a bearer token file.
type identity struct {
	Name  string `json:"name"`
	Cert  string `json:"cert,omitempty"`
	Key   string `json:"key,omitempty"`
	Token string `json:"tokenFile,omitempty"`
}

type result struct {
	Name        string         `json:"name"`
	Synced      bool           `json:"synced"`
	Seconds     float64        `json:"seconds"`
	Objects     int            `json:"objects"`
	Responses   map[string]int `json:"responses"`
	Error       string         `json:"error,omitempty"`
	WatchListOn bool           `json:"watchListClient"`
}

// counter counts responses as "<kind> <status>", kind being watch-list, watch or list.
type counter struct {
	mu     sync.Mutex
	counts map[string]int
	next   http.RoundTripper
}

func kindOf(r *http.Request) string {
	q := r.URL.Query()
	if v := q.Get("watch"); v != "" && v != "0" && !strings.EqualFold(v, "false") {
		if s := q.Get("sendInitialEvents"); s != "" && s != "0" && !strings.EqualFold(s, "false") {
			return "watch-list"
		}
		return "watch"
	}
	return "list"
}

func (c *counter) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.next.RoundTrip(r)
	key := kindOf(r) + " error"
	if err == nil {
		key = fmt.Sprintf("%s %d", kindOf(r), resp.StatusCode)
	}
	c.mu.Lock()
	c.counts[key]++
	c.mu.Unlock()
	return resp, err
}

func (c *counter) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.counts))
	for k, v := range c.counts {
		out[k] = v
	}
	return out
}

func run(ctx context.Context, server, ca, namespace string, id identity, timeout time.Duration) result {
	cfg := &rest.Config{Host: server, TLSClientConfig: rest.TLSClientConfig{CAFile: ca, CertFile: id.Cert, KeyFile: id.Key},
		BearerTokenFile: id.Token, QPS: -1, UserAgent: "gatekeeper-informers/" + id.Name}
	c := &counter{counts: map[string]int{}}
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { c.next = rt; return c }
	res := result{Name: id.Name, WatchListOn: os.Getenv("KUBE_FEATURE_WatchListClient") != "false"}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(namespace))
	informer := factory.Core().V1().Secrets().Informer()
	stop := make(chan struct{})
	defer close(stop)
	start := time.Now()
	factory.Start(stop)
	syncCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	res.Synced = cache.WaitForCacheSync(syncCtx.Done(), informer.HasSynced)
	res.Seconds = time.Since(start).Seconds()
	res.Objects = len(informer.GetStore().ListKeys())
	if !res.Synced {
		res.Error = "not synced within the timeout"
	}
	res.Responses = c.snapshot()
	return res
}

func main() {
	server := flag.String("server", "", "apiserver or proxy URL")
	ca := flag.String("ca", "", "CA bundle file")
	namespace := flag.String("namespace", "", "namespace of the Secrets ('' for all)")
	identities := flag.String("identities", "", "JSON file: a list of {name, cert, key} or {name, tokenFile}")
	timeout := flag.Duration("timeout", 10*time.Minute, "how long each informer may take to sync")
	version := flag.Bool("version", false, "print the client-go version and exit")
	flag.Parse()
	if *version {
		fmt.Println("informers (client-go " + clientGoVersion + ")")
		return
	}
	raw, err := os.ReadFile(*identities)
	if err != nil {
		fmt.Fprintln(os.Stderr, "informers:", err)
		os.Exit(2)
	}
	var ids []identity
	if err := json.Unmarshal(raw, &ids); err != nil || len(ids) == 0 {
		fmt.Fprintln(os.Stderr, "informers: --identities must be a non-empty JSON list:", err)
		os.Exit(2)
	}
	results := make([]result, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = run(context.Background(), *server, *ca, *namespace, id, *timeout)
		}()
	}
	wg.Wait()
	failed := false
	enc := json.NewEncoder(os.Stdout)
	for _, r := range results {
		_ = enc.Encode(r)
		failed = failed || !r.Synced
	}
	if failed {
		os.Exit(1)
	}
}
