package idem_test

// An adversarial review of D233 (topic D233Review): Refuse(CodeInProgress) never stored, the
// Gate's tally per Gate, DecodeJSON's number types.

import (
	"context"
	stdjson "encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-json-experiment/json"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type d233Resp struct {
	code   int
	body   string
	header http.Header
}

func d233Post(t *testing.T, url, key, body string) d233Resp {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return d233Resp{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return d233Resp{resp.StatusCode, string(b), resp.Header}
}

// TestD233ReviewRefuseAfterSuccessHeader: D233 / docs/http.md: Refuse(CodeInProgress)
// "answers 409 with Retry-After: 1 and is never stored: the work rolls back as for a 5xx". A
// handler that wrote its 201 (and body) before it called Refuse(CodeInProgress) cannot get a
// 409 any more (the status is written; net/http ignores a second one): the client gets the
// 201. Common sense and the library's own rule (a 2xx commits the work and is stored; "the work
// of a 2xx commits with its answer"; D172: an answer that says the work was done must mean it
// was): a 2xx the client receives must be the committed, stored answer. D233's first build
// rolled the work back (transactional route), or gave the lease up unanswered (lease route),
// while the client got the 2xx; a Refuse after a written status changes nothing now.
func TestD233ReviewRefuseAfterSuccessHeader(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		rt    idem.Route
		keyed bool
	}{
		{"transactional keyed", idem.Route{}, true},
		{"transactional without key", idem.Route{}, false},
		{"lease keyed", idem.Route{Lease: 5 * time.Second}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			pool, _ := pgtest.NewPool(t, 8)
			pgtest.Exec(t, pool, `CREATE TABLE public.refused_effects (id serial PRIMARY KEY)`)
			m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int32
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := runs.Add(1)
				if tx := idem.TxFrom(r.Context()); tx != nil {
					if _, err := tx.Exec(r.Context(), `INSERT INTO public.refused_effects DEFAULT VALUES`); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
				} else {
					if _, err := pool.Exec(r.Context(), `INSERT INTO public.refused_effects DEFAULT VALUES`); err != nil { // the lease's outside effect
						http.Error(w, err.Error(), 500)
						return
					}
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"id":%d}`, n)
				// A nested job (another key) is found running: the handler reports it, as
				// D233 documents, after it had started its answer.
				idem.Refuse(w, r, idem.CodeInProgress, "the sync is running; retry")
			})
			mux := http.NewServeMux()
			mux.Handle("POST /v1/x", m.Route(c.rt)(h))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			key := ""
			if c.keyed {
				key = "k1"
			}
			first := d233Post(t, srv.URL+"/v1/x", key, `{}`)
			effects := pgtest.Count(t, pool, `SELECT count(*) FROM public.refused_effects`)
			t.Logf("first: %d %q Retry-After %q; runs %d, effects committed %d", first.code, first.body, first.header.Get("Retry-After"), runs.Load(), effects)
			if first.code >= 200 && first.code < 300 && c.rt.Lease == 0 && effects == 0 {
				t.Errorf("the client got %d %s, and the work it reports was rolled back (0 effects committed): "+
					"a 2xx answer for work that did not happen", first.code, first.body)
			}
			if !c.keyed || first.code < 200 || first.code >= 300 {
				return
			}
			second := d233Post(t, srv.URL+"/v1/x", key, `{}`)
			t.Logf("repeat: %d %q replayed %q; runs %d", second.code, second.body, second.header.Get("Idempotent-Replayed"), runs.Load())
			if second.header.Get("Idempotent-Replayed") != "true" || second.body != first.body || runs.Load() != 1 {
				t.Errorf("the repeat of a request answered %d %s got %d %s (replayed %q), the handler ran %d times: "+
					"the client's 2xx was not stored as the key's answer (every repeat gets the first answer)",
					first.code, first.body, second.code, second.body, second.header.Get("Idempotent-Replayed"), runs.Load())
			}
		})
	}
}

// TestD233ReviewRefuseInProgressVariants: Refuse(CodeInProgress) "answers 409 with
// Retry-After: 1 (unless the handler set one) and is never stored: the work rolls back as for a
// 5xx, and the client's retry runs the handler again". The first run of each handler below
// refuses so, in one way; the second run answers 201, which is stored and replayed.
func TestD233ReviewRefuseInProgressVariants(t *testing.T) {
	t.Parallel()
	type variant struct {
		name       string
		rt         idem.Route
		key        string
		first      func(w http.ResponseWriter, r *http.Request)
		wantStatus int
		wantRetry  string
	}
	refuse := func(w http.ResponseWriter, r *http.Request) {
		idem.Refuse(w, r, idem.CodeInProgress, "the job runs elsewhere")
	}
	lease := idem.Route{Lease: 5 * time.Second}
	var stepRuns atomic.Int32
	step := func(r *http.Request) error {
		_, err := idem.Step(r.Context(), "charge", func(ctx context.Context, tx pgx.Tx) (int, error) {
			stepRuns.Add(1)
			return 1, nil
		})
		return err
	}
	variants := []variant{
		{"plain", idem.Route{}, "k", refuse, 409, "1"},
		{"own Retry-After", idem.Route{}, "k", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Retry-After", "7")
			refuse(w, r)
		}, 409, "7"},
		{"twice", idem.Route{}, "k", func(w http.ResponseWriter, r *http.Request) { refuse(w, r); refuse(w, r) }, 409, "1"},
		{"one-time secret", idem.Route{}, "k", func(w http.ResponseWriter, r *http.Request) {
			idem.MarkOneTimeSecret(r.Context())
			refuse(w, r)
		}, 409, "1"},
		{"then 422", idem.Route{}, "k", func(w http.ResponseWriter, r *http.Request) {
			refuse(w, r)
			idem.WriteProblem(w, 422, "https://example.com/problems/", "insufficient_funds", "no", "no", "")
		}, 409, "1"},
		{"panic after", idem.Route{}, "k", func(w http.ResponseWriter, r *http.Request) {
			refuse(w, r)
			panic("boom")
		}, 500, ""},
		{"without key", idem.Route{}, "", refuse, 409, "1"},
		{"lease", lease, "k", refuse, 409, "1"},
		{"lease after a step", lease, "k", func(w http.ResponseWriter, r *http.Request) {
			if err := step(r); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			refuse(w, r)
		}, 409, "1"},
		{"lease without key", lease, "", refuse, 409, "1"},
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			ctx := context.Background()
			pool, _ := pgtest.NewPool(t, 8)
			pgtest.Exec(t, pool, `CREATE TABLE public.refused_effects (id serial PRIMARY KEY)`)
			m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
			if err != nil {
				t.Fatal(err)
			}
			stepRuns.Store(0)
			var runs atomic.Int32
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := runs.Add(1)
				if tx := idem.TxFrom(r.Context()); tx != nil {
					if _, err := tx.Exec(r.Context(), `INSERT INTO public.refused_effects DEFAULT VALUES`); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
				}
				if n == 1 {
					v.first(w, r)
					return
				}
				if v.rt.Lease > 0 {
					if err := step(r); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"run":%d}`, n)
			})
			mux := http.NewServeMux()
			mux.Handle("POST /v1/x", m.Route(v.rt)(h))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			first := d233Post(t, srv.URL+"/v1/x", v.key, `{}`)
			if first.code != v.wantStatus || first.header.Get("Retry-After") != v.wantRetry {
				t.Errorf("first: %d Retry-After %q %s; want %d Retry-After %q", first.code, first.header.Get("Retry-After"),
					first.body, v.wantStatus, v.wantRetry)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM public.refused_effects`); n != 0 {
				t.Errorf("the refused run's work committed (%d rows)", n)
			}
			second := d233Post(t, srv.URL+"/v1/x", v.key, `{}`)
			if second.code != 201 || second.body != `{"run":2}` {
				t.Errorf("the retry: %d %s, want 201 {\"run\":2}: the refusal was stored, or the key held", second.code, second.body)
			}
			if v.key != "" {
				third := d233Post(t, srv.URL+"/v1/x", v.key, `{}`)
				if third.code != 201 || third.body != `{"run":2}` || third.header.Get("Idempotent-Replayed") != "true" {
					t.Errorf("the repeat after the 201: %d %s replayed %q", third.code, third.body, third.header.Get("Idempotent-Replayed"))
				}
				if n := runs.Load(); n != 2 {
					t.Errorf("the handler ran %d times, want 2", n)
				}
			}
			if v.name == "lease after a step" && stepRuns.Load() != 1 {
				t.Errorf("the step ran %d times: the retry's takeover, in the same generation, must skip it", stepRuns.Load())
			}
			if v.rt.Lease == 0 {
				want := 1
				if n := pgtest.Count(t, pool, `SELECT count(*) FROM public.refused_effects`); n != want {
					t.Errorf("effects committed: %d, want %d", n, want)
				}
			}
		})
	}
}

// TestD233ReviewGateCountsCoalescedHTTP: the tally is now the middleware Gate's own (D233):
// two identical keyed requests at once, the second waits in Go for the first (GateStats.Waiting
// 1), and GateStats.Coalesced counts it once; also when the first run's answer is
// Refuse(CodeInProgress), which is not stored, and the waiting request then claims and runs the
// handler itself.
func TestD233ReviewGateCountsCoalescedHTTP(t *testing.T) {
	t.Parallel()
	for _, refuseFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("refuseFirst=%v", refuseFirst), func(t *testing.T) {
			ctx := context.Background()
			pool, _ := pgtest.NewPool(t, 8)
			m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
			if err != nil {
				t.Fatal(err)
			}
			entered, release := make(chan struct{}, 4), make(chan struct{})
			var runs atomic.Int32
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := runs.Add(1)
				entered <- struct{}{}
				if n == 1 {
					<-release
					if refuseFirst {
						idem.Refuse(w, r, idem.CodeInProgress, "busy")
						return
					}
				}
				w.Header().Set("Content-Type", "application/json")
				fmt.Fprintf(w, `{"run":%d}`, n)
			})
			mux := http.NewServeMux()
			mux.Handle("POST /v1/x", m.Route(idem.Route{})(h))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			var wg sync.WaitGroup
			res := make([]d233Resp, 2)
			wg.Add(1)
			go func() { defer wg.Done(); res[0] = d233Post(t, srv.URL+"/v1/x", "same", `{"a":1}`) }()
			select {
			case <-entered:
			case <-time.After(10 * time.Second):
				close(release)
				t.Fatal("the first request never ran its handler")
			}
			wg.Add(1)
			go func() { defer wg.Done(); res[1] = d233Post(t, srv.URL+"/v1/x", "same", `{"a":1}`) }()
			deadline := time.Now().Add(5 * time.Second)
			for m.GateStats().Waiting != 1 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			waiting := m.GateStats().Waiting
			close(release)
			wg.Wait()
			if waiting != 1 {
				t.Fatalf("the second request did not wait in the Gate (Waiting %d)", waiting)
			}
			t.Logf("answers: %d %s / %d %s; runs %d; stats %+v", res[0].code, res[0].body, res[1].code, res[1].body, runs.Load(), m.GateStats())
			if refuseFirst {
				if res[0].code != 409 || res[1].code != 200 || res[1].body != `{"run":2}` {
					t.Errorf("answers %d / %d %s, want 409 / 200 {\"run\":2}", res[0].code, res[1].code, res[1].body)
				}
			} else if res[0].code != 200 || res[1].code != 200 || res[1].body != res[0].body || runs.Load() != 1 {
				t.Errorf("answers %d %s / %d %s, runs %d", res[0].code, res[0].body, res[1].code, res[1].body, runs.Load())
			}
			if c := m.GateStats().Coalesced; c != 1 {
				t.Errorf("GateStats().Coalesced = %d, want 1 (one request waited in line)", c)
			}
			if rf := m.GateStats().Refused; rf != 0 {
				t.Errorf("GateStats().Refused = %d, want 0", rf)
			}
		})
	}
}

func d233Decode(t *testing.T, text string, v any) (int, time.Duration) {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(text))
	r.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	began := time.Now()
	ok := idem.DecodeJSON(w, r, v)
	took := time.Since(began)
	if ok {
		return 200, took
	}
	return w.Code, took
}

// TestD233ReviewDecodeJSONHostileNumbers: DecodeJSON reads "*big.Int (an integer in either
// layout, up to 10,000 digits)", time.Duration and json.Number; it must never panic or hang,
// never take a non-integer into a big.Int, and decode two bodies of one fingerprint alike.
func TestD233ReviewDecodeJSONHostileNumbers(t *testing.T) {
	t.Parallel()
	type bigs struct {
		N *big.Int `json:"n"`
	}
	type bigv struct {
		N big.Int `json:"n"`
	}
	nines := strings.Repeat("9", 10000)
	for _, c := range []struct {
		text string
		want string // the big.Int, or "400"
	}{
		{`{"n":1E+21}`, "1" + strings.Repeat("0", 21)},
		{`{"n":1e21}`, "1" + strings.Repeat("0", 21)},
		{`{"n":1000000000000000000000}`, "1" + strings.Repeat("0", 21)},
		{`{"n":-0}`, "0"},
		{`{"n":-0.0}`, "0"},
		{`{"n":0.5e1}`, "5"},
		{`{"n":1.0}`, "1"},
		{`{"n":10e-1}`, "1"},
		{`{"n":1.5}`, "400"},
		{`{"n":1e-1}`, "400"},
		{`{"n":0.1e1}`, "1"},
		{`{"n":1e+9999}`, "1" + strings.Repeat("0", 9999)},
		{`{"n":1e+10000}`, "400"},
		{`{"n":1e+9999999999999999}`, "400"},
		{`{"n":` + nines + `}`, nines},
		{`{"n":` + nines + `9}`, "400"},
		{`{"n":null}`, "<nil>"},
		{`{"n":"1"}`, "400"},
		{`{"n":true}`, "400"},
	} {
		var v bigs
		code, took := d233Decode(t, c.text, &v)
		got := "400"
		if code == 200 {
			got = fmt.Sprint(v.N)
		}
		if took > 2*time.Second {
			t.Errorf("%.40s: took %v", c.text, took)
		}
		if got != c.want {
			t.Errorf("*big.Int %.60s: %d %.60s, want %.60s", c.text, code, got, c.want)
		}
		var bv bigv
		code, _ = d233Decode(t, c.text, &bv)
		if c.want != "400" && c.want != "<nil>" && (code != 200 || bv.N.String() != c.want) {
			t.Errorf("big.Int value %.60s: %d %.60s, want %.60s", c.text, code, bv.N.String(), c.want)
		}
	}
	// Nested, in maps and slices, with pointers.
	var nested struct {
		L []*big.Int                `json:"l"`
		M map[string]*big.Int       `json:"m"`
		D []time.Duration           `json:"d"`
		N map[string]stdjson.Number `json:"n"`
		P **big.Int                 `json:"p"`
	}
	if code, _ := d233Decode(t, `{"l":[1,null,1e+22],"m":{"a":-5e+21},"d":[1e9,-0],"n":{"x":12.50},"p":7}`, &nested); code != 200 {
		t.Errorf("nested: %d", code)
	} else if nested.L[0].String() != "1" || nested.L[1] != nil || nested.L[2].String() != "1"+strings.Repeat("0", 22) ||
		nested.M["a"].String() != "-5"+strings.Repeat("0", 21) || nested.D[0] != time.Second || nested.D[1] != 0 ||
		nested.N["x"] != "12.5" || (*nested.P).String() != "7" {
		t.Errorf("nested: %+v", nested)
	}
	// Durations: integers of nanoseconds, nothing else.
	for text, want := range map[string]string{`{"d":1e9}`: "1s", `{"d":1.0e9}`: "1s", `{"d":-0}`: "0s", `{"d":9223372036854775807}`: "2562047h47m16.854775807s",
		`{"d":9223372036854775808}`: "400", `{"d":1.5}`: "400", `{"d":1e-9}`: "400", `{"d":"1s"}`: "400"} {
		var v struct {
			D time.Duration `json:"d"`
		}
		code, _ := d233Decode(t, text, &v)
		got := "400"
		if code == 200 {
			got = v.D.String()
		}
		if got != want {
			t.Errorf("Duration %s: %s, want %s", text, got, want)
		}
	}
	// Two bodies of one fingerprint decode alike.
	for _, pair := range [][2]string{{`{"n":1e21}`, `{"n":1000000000000000000000.0}`}, {`{"n":12.50}`, `{"n":1.25e1}`}} {
		var a, b struct {
			N stdjson.Number `json:"n"`
		}
		ca, _ := d233Decode(t, pair[0], &a)
		cb, _ := d233Decode(t, pair[1], &b)
		if ca != 200 || cb != 200 || a.N != b.N {
			t.Errorf("%s and %s: %d %q / %d %q", pair[0], pair[1], ca, a.N, cb, b.N)
		}
	}
}

// TestD233ReviewDecodeJSONNegativeDigitBound: go doc DecodeJSON / docs/http.md: DecodeJSON
// reads "*big.Int (an integer in either layout, up to 10,000 digits)". 1e+9999 and an integer
// of 10,000 nines (10,000 digits) are read; their negatives, also of 10,000 digits, are 400
// malformed_body (a stored final answer for a keyed request) in D233's first build, whose
// bound counted the minus sign as a digit.
func TestD233ReviewDecodeJSONNegativeDigitBound(t *testing.T) {
	t.Parallel()
	type bigs struct {
		N *big.Int `json:"n"`
	}
	nines := strings.Repeat("9", 10000)
	for _, text := range []string{`{"n":1e+9999}`, `{"n":` + nines + `}`} {
		var v bigs
		if code, _ := d233Decode(t, text, &v); code != 200 {
			t.Fatalf("control: %.30s...: %d", text, code)
		}
	}
	// The bound counts digits: a negative integer of 10,000 digits is one, as the positive.
	for _, text := range []string{`{"n":-1e+9999}`, `{"n":-` + nines + `}`} {
		var v bigs
		code, _ := d233Decode(t, text, &v)
		if code != 200 {
			t.Errorf("*big.Int %.30s... (a negative integer of 10,000 digits): %d, want 200 as for its positive "+
				"(\"up to 10,000 digits\"; the sign is counted as a digit)", text, code)
		}
	}
}

// TestD233ReviewDecodeJSONNumberFromString: D233 adds json.Number so that "a struct written
// for encoding/json" decodes; encoding/json takes a JSON string holding a valid number into a
// json.Number ("12.50" -> 12.50), and map keys of type json.Number. Before D233 the v2
// semantics took both (json.Number is a string type); D233's first build refused both with 400
// malformed_body.
func TestD233ReviewDecodeJSONNumberFromString(t *testing.T) {
	t.Parallel()
	var viaStd struct {
		N stdjson.Number `json:"n"`
	}
	if err := stdjson.Unmarshal([]byte(`{"n":"12.50"}`), &viaStd); err != nil || viaStd.N != "12.50" {
		t.Fatalf("control: encoding/json: %v %q", err, viaStd.N)
	}
	var v struct {
		N stdjson.Number `json:"n"`
	}
	if code, _ := d233Decode(t, `{"n":"12.50"}`, &v); code != 200 {
		t.Errorf("a JSON string holding a number into json.Number: %d (encoding/json takes it: %q)", code, viaStd.N)
	}
	var mStd map[stdjson.Number]int
	if err := stdjson.Unmarshal([]byte(`{"12":1}`), &mStd); err != nil || mStd["12"] != 1 {
		t.Fatalf("control: encoding/json map key: %v %v", err, mStd)
	}
	// Before D233 (the v2 semantics with DecodeJSON's options of then) both were taken.
	var before struct {
		N stdjson.Number `json:"n"`
	}
	var mBefore map[stdjson.Number]int
	if err := json.Unmarshal([]byte(`{"n":"12.50"}`), &before, json.RejectUnknownMembers(true), json.MatchCaseInsensitiveNames(false)); err != nil || before.N != "12.50" {
		t.Logf("before D233: a string into json.Number: %v %q", err, before.N)
	} else {
		t.Logf("before D233 a string into json.Number was taken: %q", before.N)
	}
	if err := json.Unmarshal([]byte(`{"12":1}`), &mBefore, json.RejectUnknownMembers(true), json.MatchCaseInsensitiveNames(false)); err == nil {
		t.Logf("before D233 a map keyed by json.Number was taken: %v", mBefore)
	}
	var mk map[stdjson.Number]int
	if code, _ := d233Decode(t, `{"12":1}`, &mk); code != 200 {
		t.Errorf("a map keyed by json.Number: %d (encoding/json takes it: %v)", code, mStd)
	}
}
