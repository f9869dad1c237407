package idem_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseClientTimeoutSilentHandlerIsGivenUp (D172): a lease handler reacts to its context's
// end the way the docs recommend for a lost lease (and as a Shutdown is handled): it returns
// without writing anything. When the context ended at Route.LeaseTimeout, the middleware
// stored net/http's implicit empty 200 as the key's answer: the work never ran (the provider
// was never called), yet the impatient client "converged" on a 200 with an empty body,
// replayed, and every later retry got it for the TTL. The lease is given up now (500
// internal_error to that attempt), and the retry runs the work under the same provider key.
func TestLeaseClientTimeoutSilentHandlerIsGivenUp(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: time.Second, LeaseTimeout: 1500 * time.Millisecond},
		func(n int32, w http.ResponseWriter, r *http.Request) {
			claim, _ := idem.ClaimOf(r.Context())
			d := 5 * time.Second
			if n > 1 {
				d = 100 * time.Millisecond
			}
			select {
			case <-time.After(d): // the provider is slow the first time
			case <-r.Context().Done():
				return // stop; write nothing: nothing should be recorded
			}
			prov.pay(claim.ProviderKey)
			w.WriteHeader(http.StatusCreated)
			w.Write([]byte(`{"id":"po_1"}`))
		})
	c := &idemclient.Client{AttemptTimeout: 500 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":20}`), "")
	calls, _ := prov.counts()
	t.Logf("status %d body %q replayed %v attempts %d err %v; runs %d, provider calls %d", res.Status, res.Body, res.Replayed, res.Attempts, err, a.calls.Load(), calls)
	story, _, _ := idem.ReadKey(ctx, pool, "alice", res.Key)
	t.Logf("stored: state %s status %d body bytes %d", story.State, story.Status, story.BodyBytes)
	if res.Status == 200 && len(res.Body) == 0 {
		t.Fatalf("the client converged on an empty 200 (replayed %v) although the work never ran (provider calls %d): "+
			"a handler that stopped at LeaseTimeout without writing had its implicit 200 stored as the key's answer (%s, %d)",
			res.Replayed, calls, story.State, story.Status)
	}
	if err != nil || res.Status != 201 || calls != 1 {
		t.Fatalf("got %d %q err %v calls %d", res.Status, res.Body, err, calls)
	}
}
