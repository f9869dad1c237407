package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/gorilla/mux"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestLedgerRoutes(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")

	// Accounts: 201 with Location and ETag; stored final errors replay.
	r := s.call("POST", "/v1/accounts", alice, "acc-1", `{"name":"main","currency":"EUR"}`)
	if r.status != 201 || r.header.Get("Location") == "" || r.header.Get("ETag") != `"1"` {
		t.Fatalf("create account: %+v", r)
	}
	main := int(r.json(t)["id"].(float64))
	if again := s.call("POST", "/v1/accounts", alice, "acc-1", `{"name":"main","currency":"EUR"}`); again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %+v", again)
	}
	savings := int(s.call("POST", "/v1/accounts", alice, "", `{"name":"savings","currency":"EUR"}`).json(t)["id"].(float64))
	usd := int(s.call("POST", "/v1/accounts", alice, "", `{"name":"usd","currency":"USD"}`).json(t)["id"].(float64))
	for _, c := range []struct {
		body   string
		status int
	}{{`{"name":"x","currency":"euro"}`, 422}, {`{"name":"","currency":"EUR"}`, 422}, {`{"name":"x","currency":"EUR","extra":1}`, 400}} {
		key := "bad-" + c.body
		first := s.call("POST", "/v1/accounts", alice, key, c.body)
		again := s.call("POST", "/v1/accounts", alice, key, c.body)
		if first.status != c.status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s: %+v then %+v, want a stored %d", c.body, first, again, c.status)
		}
	}
	// JSON that is not strictly valid is refused before the claim: 400, nothing stored.
	if r := s.call("POST", "/v1/accounts", alice, "bad-truncated", `{"name":"x"`); r.status != 400 ||
		s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'bad-truncated'`) != 0 {
		t.Errorf("truncated JSON: %+v, want 400 and no key stored", r)
	}

	// GET with ETag; another principal sees nothing.
	g := s.call("GET", fmt.Sprintf("/v1/accounts/%d", main), alice, "", "")
	if g.status != 200 || g.header.Get("ETag") == "" {
		t.Fatalf("get: %+v", g)
	}
	if r := s.call("GET", fmt.Sprintf("/v1/accounts/%d", main), alice, "", "", "If-None-Match", g.header.Get("ETag")); r.status != 304 {
		t.Errorf("If-None-Match: %d", r.status)
	}
	if r := s.call("GET", fmt.Sprintf("/v1/accounts/%d", main), bob, "", ""); r.status != 404 {
		t.Errorf("bob reads alice's account: %+v", r)
	}
	if r := s.call("GET", "/v1/accounts/1", "", "", ""); r.status != 401 {
		t.Errorf("no token: %+v", r)
	}

	// Deposits.
	d := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", main), alice, "dep-1", `{"amount":1000}`)
	if d.status != 201 || d.json(t)["balance"].(float64) != 1000 {
		t.Fatalf("deposit: %+v", d)
	}
	for _, c := range []struct {
		path, body string
		status     int
	}{
		{fmt.Sprintf("/v1/accounts/%d/deposits", main), `{"amount":0}`, 422},
		{fmt.Sprintf("/v1/accounts/%d/deposits", main), `{"amount":1.5}`, 422},
		{"/v1/accounts/999999/deposits", `{"amount":5}`, 404},
	} {
		first := s.call("POST", c.path, alice, "dep-"+c.body+c.path, c.body)
		again := s.call("POST", c.path, alice, "dep-"+c.body+c.path, c.body)
		if first.status != c.status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("deposit %s %s: %+v then %+v", c.path, c.body, first, again)
		}
	}
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", main), bob, "", `{"amount":5}`); r.status != 404 {
		t.Errorf("bob deposits into alice's account: %+v", r)
	}

	// Transfers: key required; insufficient funds is a stored 422.
	tr := fmt.Sprintf(`{"from":%d,"to":%d,"amount":300}`, main, savings)
	if r := s.call("POST", "/v1/transfers", alice, "", tr); r.status != 400 || !strings.Contains(r.body, "idempotency_key_missing") {
		t.Fatalf("transfer without a key: %+v", r)
	}
	if r := s.call("POST", "/v1/transfers", alice, "tr-1", tr); r.status != 201 || r.header.Get("Location") == "" {
		t.Fatalf("transfer: %+v", r)
	}
	over := fmt.Sprintf(`{"from":%d,"to":%d,"amount":999999}`, main, savings)
	first := s.call("POST", "/v1/transfers", alice, "tr-2", over)
	again := s.call("POST", "/v1/transfers", alice, "tr-2", over)
	if first.status != 422 || !strings.Contains(first.body, `"code":"insufficient_funds"`) || again.body != first.body {
		t.Fatalf("insufficient funds: %+v then %+v", first, again)
	}
	if r := s.call("POST", "/v1/transfers", alice, "tr-3", fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, main, usd)); r.status != 422 {
		t.Errorf("currency mismatch: %+v", r)
	}
	if r := s.call("POST", "/v1/transfers", bob, "tr-4", tr); r.status != 404 {
		t.Errorf("bob moves alice's money: %+v", r)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, main); n != 700 {
		t.Fatalf("balance %d, want 700", n)
	}

	// API tokens: a one-time secret that works.
	tok := s.call("POST", "/v1/api-tokens", alice, "tok-1", `{"name":"ci"}`)
	if tok.status != 201 {
		t.Fatalf("token: %+v", tok)
	}
	token := tok.json(t)["token"].(string)
	if r := s.call("GET", fmt.Sprintf("/v1/accounts/%d", main), token, "", ""); r.status != 200 {
		t.Fatalf("the new token does not authenticate: %+v", r)
	}
	r = s.call("POST", "/v1/api-tokens", alice, "tok-1", `{"name":"ci"}`)
	if p := r.json(t); r.status != 409 || strings.Contains(r.body, token) || p["code"] != "one_time_secret" ||
		p["resource_id"] != fmt.Sprint(tok.json(t)["id"]) || !strings.Contains(p["detail"].(string), "new key") {
		t.Fatalf("token repeat: %+v, want 409 one_time_secret naming token %v and how to get another", r, tok.json(t)["id"])
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'tok-1' AND response_body IS NULL`); n != 1 {
		t.Fatal("the token was stored")
	}
}

func TestDeletedPrincipal(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, token := s.principal("gone")
	s.call("POST", "/v1/accounts", token, "k1", `{"name":"a","currency":"EUR"}`)
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id); n != 1 {
		t.Fatalf("%d keys before", n)
	}
	if _, err := s.pool.Exec(context.Background(), `DELETE FROM ledger.principals WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if r := s.call("POST", "/v1/accounts", token, "k1", `{"name":"a","currency":"EUR"}`); r.status != 401 {
		t.Fatalf("a deleted principal's token: %+v", r)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id); n != 0 {
		t.Fatalf("%d keys of a deleted principal remain", n)
	}
}

// TestOpenAPIMatchesRoutes: every route is in the document and every documented path is
// routed, with the same methods.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	t.Parallel()
	var doc struct {
		Paths map[string]map[string]struct {
			Parameters []struct {
				Ref string `json:"$ref"`
			} `json:"parameters"`
		} `json:"paths"`
	}
	if err := json.Unmarshal(openAPI, &doc); err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for path, ops := range doc.Paths {
		for method := range ops {
			documented[strings.ToUpper(method)+" "+path] = true
		}
	}
	pool, _ := pgtest.NewPool(t, 4) // idem.New checks the schema
	m := &Main{Config: Config{TransfersRequireKey: true, MaxBodyBytes: 1, MaxStoredBytes: 1},
		registry: prometheus.NewRegistry(), log: slog.New(slog.NewTextHandler(io.Discard, nil)), pool: pool}
	router, _, err := m.router(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	routed := map[string]bool{}
	_ = router.Walk(func(route *mux.Route, _ *mux.Router, _ []*mux.Route) error {
		tpl, err1 := route.GetPathTemplate()
		methods, err2 := route.GetMethods()
		if err1 == nil && err2 == nil {
			for _, meth := range methods {
				routed[meth+" "+tpl] = true
			}
		}
		return nil
	})
	var missing, unrouted []string
	for r := range routed {
		if !documented[r] {
			missing = append(missing, r)
		}
	}
	for d := range documented {
		if !routed[d] {
			unrouted = append(unrouted, d)
		}
	}
	sort.Strings(missing)
	sort.Strings(unrouted)
	if len(missing)+len(unrouted) > 0 || len(routed) < 9 {
		t.Fatalf("routes not in openapi.json: %v; documented but not routed: %v (%d routes)", missing, unrouted, len(routed))
	}
	for _, op := range []string{"/v1/transfers"} {
		refs := fmt.Sprint(doc.Paths[op]["post"].Parameters)
		if !strings.Contains(refs, "IdempotencyKeyRequired") {
			t.Errorf("%s does not document its required Idempotency-Key: %s", op, refs)
		}
	}
}

func TestMetricsAfterRequests(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("m")
	s.call("POST", "/v1/accounts", token, "k", `{"name":"a","currency":"EUR"}`)
	s.call("POST", "/v1/accounts", token, "k", `{"name":"a","currency":"EUR"}`)
	r := s.call("GET", "/metrics", "", "", "")
	for _, want := range []string{`idempotency_requests_total{action="POST /v1/accounts",state="acquired"} 1`,
		`idempotency_requests_total{action="POST /v1/accounts",state="replayed"} 1`, `idempotency_waiting_duplicates 0`} {
		if !strings.Contains(r.body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// replaySafety checks an OpenAPI document against the rules a keyed operation must follow
// to be safe to replay, and returns one line per breach, each naming the operation:
//
//   - the fingerprint covers method, path and JSON body, not the query string: a keyed
//     operation takes no query parameter and no body that is not JSON;
//   - a replay sends the stored body: a keyed operation's 2xx is JSON or empty;
//   - an ETag must be derived from a version the response always carries, so that a
//     replayed ETag and a fresh GET of the same version agree: a response with an ETag has a
//     JSON schema with a required integer version.
//
// keyed names the keyed operations as "METHOD path"; every operation is checked for ETags.
func replaySafety(doc map[string]any, keyed map[string]bool) []string {
	resolve := func(v any) map[string]any {
		m, _ := v.(map[string]any)
		for m != nil && m["$ref"] != nil {
			ref := strings.TrimPrefix(m["$ref"].(string), "#/")
			var cur any = doc
			for _, part := range strings.Split(ref, "/") {
				c, _ := cur.(map[string]any)
				cur = c[part]
			}
			m, _ = cur.(map[string]any)
		}
		return m
	}
	isJSON := func(ct string) bool { return ct == "application/json" || strings.HasSuffix(ct, "+json") }
	var breaches []string
	paths := resolve(doc["paths"])
	for path, item := range paths {
		for method, op := range resolve(item) {
			o, ok := op.(map[string]any)
			if !ok || method == "parameters" {
				continue
			}
			name := strings.ToUpper(method) + " " + path
			if keyed[name] {
				params, _ := o["parameters"].([]any)
				for _, p := range params {
					if resolve(p)["in"] == "query" {
						breaches = append(breaches, fmt.Sprintf("keyed %s takes query parameter %v, which the fingerprint does not cover", name, resolve(p)["name"]))
					}
				}
				if body := resolve(o["requestBody"]); body != nil {
					content, _ := body["content"].(map[string]any)
					for ct := range content {
						if !isJSON(ct) {
							breaches = append(breaches, fmt.Sprintf("keyed %s takes a %s body, which is fingerprinted as raw bytes", name, ct))
						}
					}
				}
			}
			responses, _ := o["responses"].(map[string]any)
			for status, r := range responses {
				res := resolve(r)
				content, _ := res["content"].(map[string]any)
				if keyed[name] && strings.HasPrefix(status, "2") {
					for ct := range content {
						if !isJSON(ct) {
							breaches = append(breaches, fmt.Sprintf("keyed %s answers %s with a %s body: a keyed 2xx is JSON or empty", name, status, ct))
						}
					}
				}
				headers, _ := res["headers"].(map[string]any)
				if headers["ETag"] == nil || method == "head" {
					continue // HEAD answers GET's headers without a body: GET's response is checked
				}
				schema := resolve(resolve(content["application/json"])["schema"])
				props, _ := schema["properties"].(map[string]any)
				required, _ := schema["required"].([]any)
				switch version := resolve(props["version"]); {
				case version == nil:
					breaches = append(breaches, fmt.Sprintf("%s %s answers an ETag without a version to derive it from", name, status))
				case version["type"] != "integer":
					breaches = append(breaches, fmt.Sprintf("%s %s answers an ETag whose version is not an integer", name, status))
				case !slices.Contains(required, any("version")):
					breaches = append(breaches, fmt.Sprintf("%s %s answers an ETag whose version is not required", name, status))
				}
			}
		}
	}
	sort.Strings(breaches)
	return breaches
}

// TestKeyedRoutesAreSafeToReplay reads /openapi.json and the router: every keyed operation
// follows the rules of replaySafety.
func TestKeyedRoutesAreSafeToReplay(t *testing.T) {
	t.Parallel()
	var doc map[string]any
	if err := json.Unmarshal(openAPI, &doc); err != nil {
		t.Fatal(err)
	}
	keyed := map[string]bool{}
	for _, rt := range ledgerRoutes(&ledger{}, true) {
		if rt.idem != nil {
			keyed[rt.method+" "+rt.path] = true
		}
	}
	if len(keyed) < 4 {
		t.Fatalf("only %d keyed routes found", len(keyed))
	}
	for _, b := range replaySafety(doc, keyed) {
		t.Error(b)
	}
}

// TestReplaySafetyRefusesBadSpecs: small documents that break each rule of replaySafety are
// refused with a line that names the operation, so the check above cannot pass by reading
// nothing.
func TestReplaySafetyRefusesBadSpecs(t *testing.T) {
	t.Parallel()
	const etag = `"headers": {"ETag": {"schema": {"type": "string"}}}`
	for _, c := range []struct{ name, op, want string }{
		{"query parameter", `{"parameters": [{"name": "dry_run", "in": "query"}], "responses": {}}`, "takes query parameter dry_run"},
		{"form body", `{"requestBody": {"content": {"application/x-www-form-urlencoded": {}}}, "responses": {}}`, "fingerprinted as raw bytes"},
		{"text 2xx", `{"responses": {"201": {"content": {"text/plain": {}}}}}`, "a keyed 2xx is JSON or empty"},
		{"ETag, no version", `{"responses": {"201": {` + etag + `, "content": {"application/json": {"schema": {"type": "object", "properties": {"id": {"type": "integer"}}}}}}}}`, "without a version"},
		{"ETag, string version", `{"responses": {"201": {` + etag + `, "content": {"application/json": {"schema": {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}}}}`, "version is not an integer"},
		{"ETag, optional version", `{"responses": {"201": {` + etag + `, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Thing"}}}}}}`, "version is not required"},
	} {
		var doc map[string]any
		spec := `{"paths": {"/x": {"post": ` + c.op + `}}, "components": {"schemas": {"Thing": {"type": "object", "properties": {"version": {"type": "integer"}}}}}}`
		if err := json.Unmarshal([]byte(spec), &doc); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		got := replaySafety(doc, map[string]bool{"POST /x": true})
		if len(got) != 1 || !strings.Contains(got[0], "POST /x") || !strings.Contains(got[0], c.want) {
			t.Errorf("%s: %q, want one line naming POST /x and %q", c.name, got, c.want)
		}
	}
}

// TestAccountETagIsItsVersion: the account's ETag is its version, so the ETag of a replayed
// creation and a GET agree until the account changes, and change with it.
func TestAccountETagIsItsVersion(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("etag")
	created := s.call("POST", "/v1/accounts", token, "acct", `{"name":"a","currency":"EUR"}`)
	replayed := s.call("POST", "/v1/accounts", token, "acct", `{"name":"a","currency":"EUR"}`)
	path := created.header.Get("Location")
	got := s.call("GET", path, token, "", "")
	if created.header.Get("ETag") != `"1"` || replayed.header.Get("ETag") != `"1"` || got.header.Get("ETag") != `"1"` {
		t.Fatalf("ETags %q, %q, %q; want \"1\" everywhere", created.header.Get("ETag"), replayed.header.Get("ETag"), got.header.Get("ETag"))
	}
	s.call("POST", path+"/deposits", token, "", `{"amount":5}`)
	after := s.call("GET", path, token, "", "")
	if v := after.json(t)["version"].(float64); after.header.Get("ETag") != fmt.Sprintf(`"%d"`, int(v)) || v != 2 {
		t.Fatalf("after a deposit: ETag %q, version %v", after.header.Get("ETag"), v)
	}
}

// TestWhatIsHashedIsWhatIsExecuted: bodies that share a fingerprint are one request. 1e2 and
// 100 canonicalize alike, so the handler reads both as 100: the first deposits 100, the
// second replays it (it used to refuse 1e2 with a stored 422 and replay that 422 to 100). A
// body that is not strictly valid JSON is refused before the claim with or without a
// Content-Type (DecodeJSON takes none as JSON), so nothing is stored. The ledger's audit
// column holds the key as the key row does, also when the client quotes it.
func TestWhatIsHashedIsWhatIsExecuted(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("alice")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"main","currency":"EUR"}`).json(t)["id"].(float64))
	path := fmt.Sprintf("/v1/accounts/%d/deposits", id)

	first := s.call("POST", path, token, "n1", `{"amount":1e2}`)
	if first.status != 201 || first.json(t)["amount"] != float64(100) {
		t.Fatalf("a deposit of 1e2: %+v", first)
	}
	for _, same := range []string{`{"amount":100}`, `{"amount":100.0}`, `{ "amount" : 1E+2 }`} {
		if again := s.call("POST", path, token, "n1", same); again.status != 201 || again.body != first.body ||
			again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("%s under the key of 1e2: %+v, want the replay of %s", same, again, first.body)
		}
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 100 {
		t.Fatalf("balance %d, want 100", n)
	}

	for _, ct := range []string{"", "application/json"} {
		key := "dup-" + ct
		r := s.call("POST", path, token, key, `{"amount":1,"amount":2}`, "Content-Type", ct)
		if r.status != 400 || !strings.Contains(r.body, `"malformed_body"`) {
			t.Fatalf("duplicate members, Content-Type %q: %+v", ct, r)
		}
		if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = $1`, key); n != 0 {
			t.Fatalf("duplicate members, Content-Type %q: the key was stored", ct)
		}
	}

	if r := s.call("POST", path, token, `"q1"`, `{"amount":5}`); r.status != 201 {
		t.Fatalf("a quoted key: %+v", r)
	}
	if n := s.count(`SELECT count(*) FROM ledger.deposits d JOIN idem.idempotency_keys k ON k.key = d.idempotency_key
		WHERE d.idempotency_key = 'q1'`); n != 1 {
		t.Fatalf("the audit column of a deposit under the quoted key \"q1\" does not hold the stored key q1")
	}
}

// TestProblemCodesAreDocumented: every problem the ledger answers has a heading of its own in
// docs/ledger.md, so its type URI's anchor (docs/ledger.md#code) leads to it, and every code
// a client can get, the ledger's and the middleware's, is in openapi.json's stable list.
func TestProblemCodesAreDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/ledger.md")
	if err != nil {
		t.Fatal(err)
	}
	spec, err := os.ReadFile("openapi.json")
	if err != nil {
		t.Fatal(err)
	}
	stable := regexp.MustCompile(`"Stable: ([^"]*)\."`).FindSubmatch(spec)
	if stable == nil {
		t.Fatal("openapi.json lists no stable problem codes")
	}
	listed := strings.Split(string(stable[1]), ", ")
	for code := range ledgerProblems {
		if !regexp.MustCompile(`(?m)^### ` + code + `$`).Match(doc) {
			t.Errorf("docs/ledger.md has no heading %q: the problem type %s%s leads nowhere", "### "+code, problemBase, code)
		}
		if !slices.Contains(listed, code) {
			t.Errorf("openapi.json's stable codes lack %s", code)
		}
	}
	for _, code := range []string{idem.CodeKeyMissing, idem.CodeKeyInvalid, idem.CodeKeyReuse, idem.CodeInProgress,
		idem.CodeOneTimeSecret, idem.CodeNotReplayable, idem.CodeRequestTooLarge, idem.CodeBodyUnreadable, idem.CodeBodyIncomplete,
		idem.CodeMalformedBody, idem.CodeUnsupportedMedia, idem.CodePrincipalUnknown, idem.CodeInternalError,
		idem.CodeMisconfigured, idem.CodeStoreUnavailable, idem.CodeOutcomeUnknown} {
		if !slices.Contains(listed, code) {
			t.Errorf("openapi.json's stable codes lack the middleware's %s", code)
		}
	}
}
