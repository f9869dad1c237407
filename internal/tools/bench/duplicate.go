package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// duplicateRounds is how many first requests each variant of the duplicate part sends (at
// once, under keys of their own), each with its duplicate.
const duplicateRounds = 5

// duplicatePart measures how long after the first answer exists a duplicate has it: a request
// whose work takes 2 s, and the same request 0.3 s later, on a transactional route (the work
// sleeps in the request's transaction) and on a lease route (lease 10 s, the work outside the
// database), the duplicate sent to the same middleware ("this process") or to a second one on
// the same database ("another process", which has only the database to learn from). The figure
// is the largest delay between the first's answer reaching its client and the duplicate's
// reaching its own, over duplicateRounds keys per variant; the budget is 0.5 s.
func duplicatePart(ctx context.Context, b *bench) error {
	if err := b.database(ctx, "bench"); err != nil {
		return err
	}
	pool, err := openPool(ctx, b.url, "bench", 16, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	serve := func() (*httptest.Server, error) {
		m, err := idemhttp.New(idemhttp.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return principal, true },
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			return nil, err
		}
		mux := http.NewServeMux()
		answer := func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, `{"done":true}`)
		}
		mux.Handle("POST /tx", m.Route(idemhttp.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `SELECT pg_sleep(2)`); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			answer(w)
		})))
		mux.Handle("POST /lease", m.Route(idemhttp.Route{Lease: 10 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(2 * time.Second)
			answer(w)
		})))
		return httptest.NewServer(mux), nil
	}
	here, err := serve()
	if err != nil {
		return err
	}
	defer here.Close()
	there, err := serve()
	if err != nil {
		return err
	}
	defer there.Close()

	run := fmt.Sprintf("dup-%d", time.Now().UnixNano())
	post := func(url, key string) (time.Time, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"n":1}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return time.Time{}, err
		}
		defer res.Body.Close()
		_, _ = io.Copy(io.Discard, res.Body)
		if res.StatusCode != http.StatusCreated {
			return time.Time{}, fmt.Errorf("%s %s: %d", url, key, res.StatusCode)
		}
		return time.Now(), nil
	}
	type variant struct{ name, route, dupTo string }
	variants := []variant{
		{"transactional route, this process", "/tx", here.URL},
		{"transactional route, another process", "/tx", there.URL},
		{"lease route, this process", "/lease", here.URL},
		{"lease route, another process", "/lease", there.URL},
	}
	delays := make([][]time.Duration, len(variants))
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		errs []error
	)
	for v, vr := range variants {
		for i := range duplicateRounds {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprintf("%s-%d-%d", run, v, i)
				var first, dup time.Time
				var ferr, derr error
				done := make(chan struct{})
				go func() { first, ferr = post(here.URL+vr.route, key); close(done) }()
				time.Sleep(300 * time.Millisecond)
				dup, derr = post(vr.dupTo+vr.route, key)
				<-done
				mu.Lock()
				defer mu.Unlock()
				if ferr != nil || derr != nil {
					errs = append(errs, fmt.Errorf("%s: first %v, duplicate %v", vr.name, ferr, derr))
					return
				}
				delays[v] = append(delays[v], max(dup.Sub(first), 0))
			}()
		}
	}
	wg.Wait()
	if len(errs) > 0 {
		return errs[0]
	}
	for v, vr := range variants {
		worst := slices.Max(delays[v])
		fmt.Printf("duplicate, %s: the answer %v after the first's (the largest of %d)\n", vr.name, worst.Round(time.Millisecond), len(delays[v]))
		b.check("a duplicate's answer after the first's, "+vr.name+" (s)", fmt.Sprintf("%.3f", worst.Seconds()), worst.Seconds(),
			"<=", 0.5, "%.1f")
	}
	return nil
}
