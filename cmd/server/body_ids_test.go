package main

import (
	"fmt"
	"strings"
	"testing"
)

// TestBodyAccountIDsAreReadAsAmounts (D263): an account id in a body (a transfer's from and
// to, a payout's account) is read as an amount is: a positive integer of 64 bits, else 422
// validation_failed. A fraction or an id past the range was 400 malformed_body ("exactly the
// documented members", which they were), 0 or a negative 422, and a payout's negative account
// 404: three answers, each stored as final, for one kind of mistake.
func TestBodyAccountIDsAreReadAsAmounts(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a, b := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR")
	reviewDeposit(t, s, token, a, 100)
	n := 0
	send := func(path, body string) resp {
		n++
		return s.call("POST", path, token, fmt.Sprintf("ids-%d", n), body)
	}
	for _, id := range []string{"0", "-1", "1.5", "99999999999999999999", "1e30", "-0.5"} {
		bodies := map[string]string{
			"/v1/transfers":       fmt.Sprintf(`{"from":%s,"to":%d,"amount":1}`, id, b),
			"/v1/transfers ":      fmt.Sprintf(`{"from":%d,"to":%s,"amount":1}`, a, id),
			"/v1/payouts":         fmt.Sprintf(`{"account":%s,"amount":1}`, id),
			"/v1/stepped-payouts": fmt.Sprintf(`{"account":%s,"amount":1}`, id),
		}
		for path, body := range bodies {
			r := send(strings.TrimSpace(path), body)
			if r.status != 422 || !strings.Contains(r.body, `"code":"validation_failed"`) {
				t.Errorf("POST %s %s: %d %s, want 422 validation_failed", path, body, r.status, r.body)
			}
		}
	}
	// An id of another type is still a malformed body; an integer written another way is an id.
	if r := send("/v1/transfers", fmt.Sprintf(`{"from":"%d","to":%d,"amount":1}`, a, b)); r.status != 400 {
		t.Errorf("a string id: %d %s, want 400", r.status, r.body)
	}
	if r := send("/v1/transfers", fmt.Sprintf(`{"from":%d.0,"to":%de0,"amount":1}`, a, b)); r.status != 201 {
		t.Errorf("ids written %d.0 and %de0: %d %s, want 201", a, b, r.status, r.body)
	}
}
