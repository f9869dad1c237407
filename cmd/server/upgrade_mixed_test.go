package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
	"github.com/pgidem/pgidem/internal/release020"
)

// TestUpgradeMixedServers: step 2 of a rolling upgrade (docs/operations.md): after this
// tree's migrate, 0.2.0's server and this tree's serve the same database at once, and a
// client's retry may reach either. Every answer either stored replays through the other, byte
// for byte (status, body, stored headers), marked replayed.
func TestUpgradeMixedServers(t *testing.T) {
	t.Parallel()
	binary020(t)
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	if err := release020.Migrate(ctx, url); err != nil {
		t.Fatal(err)
	}
	_, token, err := release020.Principal(ctx, url, "alice")
	if err != nil {
		t.Fatal(err)
	}
	old, err := release020.Serve(ctx, url, map[string]string{"PAYOUT_PROVIDER_DELAY": "10ms"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = old.Kill() })
	k := keyedSender{t: t, token: token}
	account := func(base, key string) (exchange, int64) {
		e := k.send(base, "POST", "/v1/accounts", key, `{"name":"`+key+`","currency":"EUR"}`)
		var a struct{ ID int64 }
		if e.status != http.StatusCreated || json.Unmarshal([]byte(e.resp), &a) != nil {
			t.Fatalf("POST /v1/accounts on %s: %v", base, e)
		}
		return e, a.ID
	}
	preAcct, a1 := account(old.URL, "acct-old-before")
	_, a2 := account(old.URL, "acct-old-before-2")
	preDep := k.send(old.URL, "POST", fmt.Sprintf("/v1/accounts/%d/deposits", a1), "dep-old-before", `{"amount":5}`)
	prePay := k.send(old.URL, "POST", "/v1/payouts", "pay-old-before", fmt.Sprintf(`{"account":%d,"amount":1}`, a1))

	migrateLogged(t, url)
	s := serveOn(t, url, nil)

	var stored []struct {
		by string
		e  exchange
	}
	add := func(by string, e exchange) {
		if e.status >= 500 || !e.stored() {
			t.Errorf("%s answered %s %s (key %s): %v", by, e.method, e.path, e.key, e)
			return
		}
		stored = append(stored, struct {
			by string
			e  exchange
		}{by, e})
	}
	add("0.2.0 before the migrate", preAcct)
	add("0.2.0 before the migrate", preDep)
	add("0.2.0 before the migrate", prePay)
	for _, srv := range []struct{ name, base string }{{"0.2.0 after the migrate", old.URL}, {"this tree", s.url}} {
		p := srv.name[:3]
		e, _ := account(srv.base, "acct-"+p)
		add(srv.name, e)
		add(srv.name, k.send(srv.base, "POST", fmt.Sprintf("/v1/accounts/%d/deposits", a1), "dep-"+p, `{"amount":2}`))
		add(srv.name, k.send(srv.base, "POST", "/v1/transfers", "xfer-"+p, fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, a1, a2)))
		add(srv.name, k.send(srv.base, "POST", "/v1/transfers", "xfer-refused-"+p, fmt.Sprintf(`{"from":%d,"to":%d,"amount":1000000000}`, a2, a1)))
		add(srv.name, k.send(srv.base, "POST", "/v1/payouts", "pay-"+p, fmt.Sprintf(`{"account":%d,"amount":1}`, a1)))
	}
	for _, st := range stored {
		for _, srv := range []struct{ name, base string }{{"0.2.0", old.URL}, {"this tree", s.url}} {
			again := k.send(srv.base, st.e.method, st.e.path, st.e.key, st.e.body)
			if !again.same(st.e) || again.header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("%s %s key %s, answered by %s: through %s %v, want %v replayed", st.e.method, st.e.path, st.e.key, st.by, srv.name, again, st.e)
			}
		}
	}
	if t.Failed() {
		t.Logf("0.2.0's log:\n%s", old.Log())
	}
}
