package idem_test

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseClientStalledHolderClientConverges: process A's database link stalls mid-work (a
// black-holed connection), so its lease runs out. The default client, whose first attempt
// waits on A, retries on process B (same database). A's attempt answered 409 with a
// Retry-After of the whole lease after trying to give its claim up for a lease (the lease had
// run out by its clock already): about three leases in all. A's give-up is bounded as
// giveUpUnknownClaim's (the lease, at most 5 s), and its 409 says Retry-After: 1 (the retry
// learns from the database whether the key is taken); D172.
func TestLeaseClientStalledHolderClientConverges(t *testing.T) {
	t.Parallel()
	direct, url := pgtest.NewPool(t, 8)
	proxy := toxiproxy.NewProxy(toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop()),
		"postgres-"+t.Name(), "127.0.0.1:0", pgtest.TCPAddr(t))
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	defer proxy.Stop()
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, proxy.Listen))
	if err != nil {
		t.Fatal(err)
	}
	stalled, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	prov := &clientProv{}
	const lease = 2 * time.Second
	a := clientLeaseServe(t, stalled, idem.Options{}, idem.Route{Required: true, Lease: lease}, clientPay(prov, 6*time.Second))
	b := clientLeaseServe(t, direct, idem.Options{}, idem.Route{Required: true, Lease: lease}, clientPay(prov, 200*time.Millisecond))
	front := clientFront(t, func(n int32) string {
		if n == 1 {
			return a.srv.URL
		}
		return b.srv.URL
	})
	go func() {
		for a.calls.Load() == 0 {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(300 * time.Millisecond)
		for _, stream := range []string{"upstream", "downstream"} {
			if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(
				`{"name":"stall-` + stream + `","type":"timeout","stream":"` + stream + `","toxicity":1,"attributes":{"timeout":0}}`)); err != nil {
				t.Error(err)
			}
		}
	}()
	began0 := time.Now()
	logRT := &clientLogRT{t: t, began: began0}
	c := &idemclient.Client{HTTP: &http.Client{Transport: logRT}}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	began := time.Now()
	res, err := c.Do(ctx, clientPayReq(t, front.URL, `{"amount":30}`), "")
	took := time.Since(began)
	calls, keys := prov.counts()
	t.Logf("status %d %s replayed %v attempts %d took %v; runs A %d B %d; calls %d keys %d", res.Status, res.Body, res.Replayed, res.Attempts, took, a.calls.Load(), b.calls.Load(), calls, keys)
	for _, stream := range []string{"upstream", "downstream"} {
		_ = proxy.Toxics.RemoveToxic(context.Background(), "stall-"+stream)
	}
	if err != nil || res.Status != 201 || keys != 1 {
		t.Fatalf("got %d %s attempts %d err %v", res.Status, res.Code(), res.Attempts, err)
	}
	// The lease ran out at most 2 s after the stall (0.3 s in); A's give-up takes at most the
	// lease more, then the retry on B takes over.
	if took > 300*time.Millisecond+3*lease {
		t.Errorf("converged after %v: the lease (2 s) ran out ~2.3 s in, and B could take over then", took)
	}
	logRT.mu.Lock()
	defer logRT.mu.Unlock()
	for _, ra := range logRT.conflicts {
		if ra != "1" {
			t.Errorf("a 409 said Retry-After %q after the lease had run out by the holder's clock; want 1", ra)
		}
	}
}

type clientLogRT struct {
	t         *testing.T
	began     time.Time
	mu        sync.Mutex
	conflicts []string // the Retry-After of each 409
}

func (l *clientLogRT) RoundTrip(r *http.Request) (*http.Response, error) {
	res, err := http.DefaultTransport.RoundTrip(r)
	if err != nil {
		l.t.Logf("at %v: error %v", time.Since(l.began).Round(10*time.Millisecond), err)
		return res, err
	}
	l.t.Logf("at %v: %d Retry-After %q", time.Since(l.began).Round(10*time.Millisecond), res.StatusCode, res.Header.Get("Retry-After"))
	if res.StatusCode == http.StatusConflict {
		l.mu.Lock()
		l.conflicts = append(l.conflicts, res.Header.Get("Retry-After"))
		l.mu.Unlock()
	}
	return res, err
}
