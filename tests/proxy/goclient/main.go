// goclient fires N GETs with P in flight through Go's own HTTP/2 client (net/http,
// the transport client-go is built on) and prints a JSON summary of status codes and
// errors. Tests use it as the reference HTTP/2 client for GOAWAY behaviour: Go
// finishes streams at or below a GOAWAY's last stream id and retries refused ones on
// a new connection. Standard library only, so it builds offline.
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
	out, _ := json.Marshal(map[string]any{"codes": codes, "errors": errs})
	fmt.Println(string(out))
}
