// Command noopwebhook answers every AdmissionReview "allowed" with no patch, over TLS, and does nothing else.
//
// It is the floor of an admission webhook's cost: what the apiserver spends to call any webhook (encode the
// object, a TLS round trip, decode the answer) with a server that takes no decision. The admission scenario
// registers it with gatekeeper's own rules and matchConditions, so the difference between the two arms is what
// gatekeeper's policies and its Python server add on top of calling a webhook at all.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"

	admissionv1 "k8s.io/api/admission/v1"
)

var clientGoVersion = "unknown"

// maxBody bounds what one review may send: the apiserver's own request limit is 3 MiB.
const maxBody = 3 << 20

func review(w http.ResponseWriter, r *http.Request) {
	var in admissionv1.AdmissionReview
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil || len(body) > maxBody {
		http.Error(w, "body unreadable or over 3 MiB", http.StatusRequestEntityTooLarge)
		return
	}
	if err := json.Unmarshal(body, &in); err != nil || in.Request == nil {
		http.Error(w, "not an AdmissionReview with a request", http.StatusBadRequest)
		return
	}
	out := admissionv1.AdmissionReview{TypeMeta: in.TypeMeta,
		Response: &admissionv1.AdmissionResponse{UID: in.Request.UID, Allowed: true}}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(&out)
}

func main() {
	addr := flag.String("address", "127.0.0.1:0", "host:port to listen on (port 0: any free port)")
	cert := flag.String("cert", "", "serving certificate (PEM)")
	key := flag.String("key", "", "serving key (PEM)")
	portFile := flag.String("port-file", "", "write the bound port here once listening")
	version := flag.Bool("version", false, "print the client-go version this was built with and exit")
	flag.Parse()
	if *version {
		fmt.Println("noopwebhook k8s.io/api", clientGoVersion)
		return
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	if *portFile != "" {
		port := ln.Addr().(*net.TCPAddr).Port
		if err := os.WriteFile(*portFile, []byte(fmt.Sprintf("%d\n", port)), 0o644); err != nil {
			log.Fatal(err)
		}
	}
	log.Fatal(http.ServeTLS(ln, http.HandlerFunc(review), *cert, *key))
}
