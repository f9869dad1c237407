package idemclient_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// An operation whose first answer is lost (the server answers 503, as a server whose
// database connection dropped while committing does): the client retries with the same key
// and the same body, and the server's replay tells that the first attempt took effect.
func ExampleClient_Do() {
	var attempts atomic.Int32
	keys := make(chan string, 3)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys <- r.Header.Get("Idempotency-Key")
		b, _ := io.ReadAll(r.Body)
		if attempts.Add(1) == 1 {
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":1,"body":%s}`, b)
	}))
	defer srv.Close()

	c := &idemclient.Client{AttemptTimeout: 2 * time.Second, Backoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/v1/orders", strings.NewReader(`{"sku":"a1"}`))
	req.Header.Set("Content-Type", "application/json")
	res, err := c.Do(context.Background(), req, "order-7")
	fmt.Println(res.Status, res.Replayed, res.Attempts, string(res.Body), err)
	fmt.Println(<-keys == "order-7", <-keys == "order-7")
	// Output:
	// 201 true 2 {"order":1,"body":{"sku":"a1"}} <nil>
	// true true
}

// Keys made by NewKey are UUIDs of version 7, time-ordered: a later key sorts after an
// earlier one.
func ExampleNewKey() {
	first, second := idemclient.NewKey(), idemclient.NewKey()
	fmt.Println(len(first), first[14:15], first < second)
	// Output:
	// 36 7 true
}
