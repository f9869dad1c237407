package idem_test

import (
	"bytes"
	"compress/flate"
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

// rawDeflated compresses a route's answer with Content-Encoding: deflate as
// github.com/go-chi/chi/v5/middleware.Compress does (its deflate encoder is
// compress/flate.NewWriter: raw DEFLATE, no zlib header), and as many servers and
// browsers treat "deflate".
var rawDeflated = compressing("deflate", func(w io.Writer) io.WriteCloser {
	fw, _ := flate.NewWriter(w, flate.DefaultCompression)
	return fw
})

// withheldRepeat serves answer (withheld: over MaxStoredBodyBytes) on a keyed route wrapped
// by wrap, sends it twice with key and acceptEncoding, and returns the repeat's status, code
// and resource_id.
func withheldRepeat(t *testing.T, wrap func(http.Handler) http.Handler, answer []byte, key, acceptEncoding string) (int, string, string) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet, MaxStoredBodyBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(answer)
	}))))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	send := func() (int, string, string) {
		req, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(`{"sku":"a1"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Accept-Encoding", acceptEncoding)
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
		if resp.StatusCode != http.StatusCreated {
			_ = json.Unmarshal(b, &p)
		}
		return resp.StatusCode, p.Code, p.ResourceID
	}
	if st, _, _ := send(); st != http.StatusCreated {
		t.Fatalf("setup: first request %d", st)
	}
	return send()
}

// incompressibleAnswer is a 201's JSON body with the top-level id acc_42, over a
// MaxStoredBodyBytes of 64 whether it is compressed or not.
func incompressibleAnswer() []byte {
	noise := make([]byte, 300)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range noise {
		noise[i] = byte(rng.Uint32())
	}
	return []byte(`{"id":"acc_42","statement":"` + base64.StdEncoding.EncodeToString(noise) + `"}`)
}

// TestCompressedWithheldBodyKeepsItsResourceID: docs/http.md, response_not_replayable:
// "409. The first response was larger than the storage limit; resource_id names what it
// created: what the handler named with SetResourceID, else the top-level id of the first
// response's JSON body, else its Location".
//
// A handler behind a compressing middleware inside the route stores its body as sent, with its
// Content-Encoding (D183). When such a body was withheld (over MaxStoredBodyBytes), the
// middleware looked for the top-level "id" in the compressed bytes, found none, and the
// repeat's 409 had no resource_id: the client could not find what the first request created.
// The body is decoded for its "id" now: gzip, and deflate as a zlib stream or as raw DEFLATE
// (chi's Compress writes raw DEFLATE for "deflate"; the first build of the decoding read only
// zlib).
func TestCompressedWithheldBodyKeepsItsResourceID(t *testing.T) {
	t.Parallel()
	answer := incompressibleAnswer()
	for _, c := range []struct {
		name, accept string
		wrap         func(http.Handler) http.Handler
	}{
		{"uncompressed", "identity", gzipped},
		{"gzip", "gzip", gzipped},
		{"raw deflate", "deflate", rawDeflated},
	} {
		st, code, id := withheldRepeat(t, c.wrap, answer, "k-"+strings.ReplaceAll(c.name, " ", "-"), c.accept)
		if st != http.StatusConflict || code != "response_not_replayable" || id != "acc_42" {
			t.Errorf("%s: the repeat of a withheld answer: %d %s resource_id %q, want 409 response_not_replayable with resource_id acc_42",
				c.name, st, code, id)
		}
	}
}

// TestPlainWithheldBodyIDAfter16MiB: before D183's review an uncompressed withheld body
// was scanned whole for its top-level "id" (topLevelID(rec.body.Bytes())); the first build of
// bodyID put the 16 MiB bound meant for decoded bodies on plain ones too, so a large plain
// answer whose "id" follows a big member lost its resource_id. Plain bodies are read whole
// again.
func TestPlainWithheldBodyIDAfter16MiB(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	b.WriteString(`{"statement":"`)
	b.WriteString(strings.Repeat("x", 17<<20))
	b.WriteString(`","id":"acc_42"}`)
	st, code, id := withheldRepeat(t, func(h http.Handler) http.Handler { return h }, b.Bytes(), "k-big-plain", "identity")
	if st != http.StatusConflict || code != "response_not_replayable" || id != "acc_42" {
		t.Errorf("repeat of a withheld uncompressed 17 MiB answer whose id follows its statement: %d %s resource_id %q, "+
			"want 409 response_not_replayable with resource_id acc_42 (found before D183's review)", st, code, id)
	}
}
