package idemhttp_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPrincipalUnknownSpanOutcome: the span idem.request carries, as idem.outcome, the
// request's state, or principal_unknown for a request counted in no state (D219), which
// docs/http.md did not list when D219 made it.
func TestPrincipalUnknownSpanOutcome(t *testing.T) {
	t.Parallel()
	recorder := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	a := newApp(t, func(o *idemhttp.Options) { o.TracerProvider = tp })
	pgtest.Exec(t, a.pool, `CREATE TABLE principals (id text PRIMARY KEY); INSERT INTO principals VALUES ('alice');
		ALTER TABLE idem.idempotency_keys ADD FOREIGN KEY (principal_id) REFERENCES principals (id)`)
	r := a.do("POST", "/transfers", "mallory", "span-pu", `{"amount":1}`)
	if r.status != 401 || problemCode(t, r) != idemhttp.CodePrincipalUnknown {
		t.Fatalf("an unknown principal: %+v", r)
	}
	documented := map[string]bool{"acquired": true, "replayed": true, "busy": true, "key_reused": true, "store_error": true,
		"principal_unknown": true, "shutdown": true}
	found := false
	for _, s := range recorder.Ended() {
		if s.Name() != "idem.request" {
			continue
		}
		found = true
		var outcome string
		for _, kv := range s.Attributes() {
			if kv.Key == attribute.Key("idem.outcome") {
				outcome = kv.Value.AsString()
			}
		}
		if !documented[outcome] {
			t.Errorf("idem.request of a 401 principal_unknown has idem.outcome %q, which docs/http.md does not list", outcome)
		}
		if outcome != "principal_unknown" {
			t.Errorf("idem.request of a 401 principal_unknown has idem.outcome %q, want principal_unknown", outcome)
		}
	}
	if !found {
		t.Fatal("no idem.request span")
	}
}
