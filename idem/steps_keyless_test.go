package idem_test

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStepKeylessSameNameAgainIsTheSameValue: on a lease route, a request without a key
// "saves nothing (Step returns fn's value as it is)"; "the same name again returns the saved
// value". Within one such request the first call and the same name again should give one value.
func TestStepKeylessSameNameAgainIsTheSameValue(t *testing.T) {
	t.Parallel()
	raw := json.RawMessage(`{ "b": 1,  "a": 1e+21 }`)
	var first, again json.RawMessage
	var err1, err2 error
	srv, _ := auditServer(t, idem.Options{}, idem.Route{Action: "POST /things", Lease: 2 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			first, err1 = idem.Step(r.Context(), "v", func(context.Context, pgx.Tx) (json.RawMessage, error) { return raw, nil })
			again, err2 = idem.Step(r.Context(), "v", func(context.Context, pgx.Tx) (json.RawMessage, error) { return json.RawMessage(`"ran again"`), nil })
			w.WriteHeader(http.StatusCreated)
		})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	status, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/things", `{"a":1}`, "Content-Type", "application/json")
	if status != http.StatusCreated || err1 != nil || err2 != nil {
		t.Fatalf("keyless request: %d %s; %v %v", status, body, err1, err2)
	}
	if string(first) != string(again) {
		t.Errorf("a keyless request's step: the first call got %s, the same name again %s", first, again)
	}
}
