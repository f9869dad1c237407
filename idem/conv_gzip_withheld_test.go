package idem_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCompressedWithheldBodyKeepsItsResourceID: docs/http.md, response_not_replayable:
// "409. The first response was larger than the storage limit; resource_id names what it
// created: what the handler named with SetResourceID, else the top-level id of the first
// response's JSON body, else its Location"; and "What happens": "a repeat of it | 409
// response_not_replayable with resource_id".
//
// A handler behind a compressing middleware inside the route stores its body as sent, with its
// Content-Encoding (D183). When such a body was withheld (over MaxStoredBodyBytes), the
// middleware looked for the top-level "id" in the gzip bytes, found none, and the repeat's 409
// had no resource_id: the client could not find what the first request created. The body is
// decoded for its "id" now (gzip and deflate).
func TestCompressedWithheldBodyKeepsItsResourceID(t *testing.T) {
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet, MaxStoredBodyBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	noise := make([]byte, 300)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range noise {
		noise[i] = byte(rng.Uint32())
	}
	// Incompressible: over MaxStoredBodyBytes compressed or not.
	answer := `{"id":"acc_42","statement":"` + base64.StdEncoding.EncodeToString(noise) + `"}`
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(gzipped(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(answer))
	}))))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	send := func(key, acceptEncoding string) (int, string) {
		req, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(`{"sku":"a1"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Accept-Encoding", acceptEncoding) // set: net/http hands the body over as sent
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var p struct {
			Code       string `json:"code"`
			ResourceID string `json:"resource_id"`
		}
		_ = json.Unmarshal(b, &p)
		if resp.StatusCode == http.StatusConflict && p.Code != "response_not_replayable" {
			t.Fatalf("repeat of %s: %d %s", key, resp.StatusCode, b)
		}
		return resp.StatusCode, p.ResourceID
	}
	// The control: sent uncompressed, the repeat names what was created.
	if st, _ := send("k-plain", "identity"); st != http.StatusCreated {
		t.Fatalf("setup: first request %d", st)
	}
	if st, id := send("k-plain", "identity"); st != http.StatusConflict || id != "acc_42" {
		t.Fatalf("setup: repeat of an uncompressed withheld answer: %d resource_id %q, want 409 acc_42", st, id)
	}
	// Compressed by the route's middleware: the repeat has no resource_id.
	if st, _ := send("k-gzip", "gzip"); st != http.StatusCreated {
		t.Fatalf("setup: first request %d", st)
	}
	if st, id := send("k-gzip", "gzip"); st != http.StatusConflict || id != "acc_42" {
		t.Errorf("repeat of a withheld answer a compressing middleware inside the route sent: %d resource_id %q, want 409 with resource_id acc_42 "+
			"(the same answer uncompressed gets it)", st, id)
	}
}
