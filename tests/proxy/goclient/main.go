// goclient fires N GETs with P in flight through Go's own HTTP/2 client (net/http,
// the transport client-go is built on) and prints a JSON summary of status codes and
// errors. Tests use it as the reference HTTP/2 client for GOAWAY behaviour: Go
// finishes streams at or below a GOAWAY's last stream id and retries refused ones on
// a new connection. With -watch it first opens a long-running GET on the same
// transport and reports how it ended (client-go treats "server sent GOAWAY and closed
// the connection" as a probable EOF and re-watches). Standard library only, so it
// builds offline.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"time"
)

func main() {
	ca := flag.String("ca", "", "CA bundle (PEM) that signed the server certificate")
	cert := flag.String("cert", "", "client certificate (PEM)")
	key := flag.String("key", "", "client key (PEM)")
	n := flag.Int("n", 100, "requests in total")
	par := flag.Int("p", 20, "requests in flight at once")
	watchURL := flag.String("watch", "", "long-running GET to hold open while the requests run")
	watchWait := flag.Duration("watch-wait", 60*time.Second, "how long to wait for the watch to end")
	flag.Parse()
	urls := flag.Args()
	if len(urls) == 0 {
		fmt.Fprintln(os.Stderr, "usage: goclient [flags] URL...")
		os.Exit(2)
	}
	pool := x509.NewCertPool()
	pem, err := os.ReadFile(*ca)
	if err != nil || !pool.AppendCertsFromPEM(pem) {
		fmt.Fprintln(os.Stderr, "cannot read CA bundle", *ca, err)
		os.Exit(2)
	}
	cfg := &tls.Config{RootCAs: pool}
	if *cert != "" {
		c, err := tls.LoadX509KeyPair(*cert, *key)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	tr := &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: true, MaxIdleConnsPerHost: 100}
	client := &http.Client{Transport: tr, Timeout: 60 * time.Second}
	type watchResult struct {
		Bytes   int64   `json:"bytes"`
		Error   string  `json:"error"`
		Seconds float64 `json:"seconds"`
	}
	var wres watchResult
	watchDone := make(chan struct{})
	if *watchURL != "" {
		started := make(chan struct{})
		go func() {
			defer close(watchDone)
			t0 := time.Now()
			resp, err := (&http.Client{Transport: tr}).Get(*watchURL) // no overall timeout: it streams
			if err != nil {
				wres.Error = err.Error()
				close(started)
				return
			}
			close(started)
			n, err := io.Copy(io.Discard, resp.Body)
			wres.Bytes = n
			wres.Error = "clean end of body"
			if err != nil {
				wres.Error = err.Error()
			}
			wres.Seconds = time.Since(t0).Seconds()
		}()
		<-started
	} else {
		close(watchDone)
	}
	var mu sync.Mutex
	codes := map[string]int{}
	errs := map[string]int{}
	sem := make(chan struct{}, *par)
	var wg sync.WaitGroup
	for i := 0; i < *n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			resp, err := client.Get(urls[i%len(urls)])
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs[err.Error()]++
			} else {
				codes[fmt.Sprintf("%d %s", resp.StatusCode, resp.Proto)]++
			}
		}(i)
	}
	wg.Wait()
	result := map[string]any{"codes": codes, "errors": errs}
	if *watchURL != "" {
		select {
		case <-watchDone:
			result["watch"] = wres
		case <-time.After(*watchWait):
			result["watch"] = watchResult{Error: "still open"}
		}
	}
	out, _ := json.Marshal(result)
	fmt.Println(string(out))
}
