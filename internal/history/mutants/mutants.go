// Package mutants is the history checker's own measure: single-point changes that break a
// promise of the contract, in the SQL functions, the Go driver and the HTTP middleware. `make
// mutants` (internal/tools/mutants) applies each to a scratch copy of the tree and runs the
// short mode of the history tests against it with three seeds: the checker should fail every
// run of every mutant (docs/testing.md, "The checker's own measure").
package mutants

// Mutant is one change: in File, the text Search (which occurs exactly once) becomes Replace.
type Mutant struct {
	// Name is short and stable (the kill table's row); Promise the promise it breaks.
	Name, Promise string
	// File is the path from the module's root.
	File            string
	Search, Replace string
	// Expected names the history tests meant to kill it (documentation: every test runs).
	Expected string
}

// All are the mutants, in the kill table's order.
var All = []Mutant{
	{
		Name: "sql-fingerprint", Promise: "another request under a bound key is a mismatch (idem_begin ignores the body's hash)",
		File:     "sql/functions/idem_begin.sql",
		Search:   "        ELSIF v_row.action_hash <> v_action OR v_row.request_sha256 <> p_request_sha256 THEN\n",
		Replace:  "        ELSIF v_row.action_hash <> v_action THEN\n",
		Expected: "every harness: changed body",
	},
	{
		Name: "sql-fencing", Promise: "a claim taken over cannot store its answer (idem_complete ignores the attempt)",
		File:     "sql/functions/idem_complete.sql",
		Search:   "       AND k.attempt = p_attempt AND k.state = 'p'\n       -- A lease claim past its TTL",
		Replace:  "       AND k.state = 'p'\n       -- A lease claim past its TTL",
		Expected: "TestSQLHistory: stale holder",
	},
	{
		Name: "sql-provider-key", Promise: "a takeover keeps the generation's provider key (it gets one of its own)",
		File:     "sql/functions/idem_begin.sql",
		Search:   "            outcome := 'claimed';\n            provider_key := {{ template \"include/provider_key.sql\" \"v_gen\" }};\n",
		Replace:  "            outcome := 'claimed';\n            provider_key := {{ template \"include/provider_key.sql\" \"v_token\" }};\n",
		Expected: "TestSQLHistory: stale holder, dead lease taken over",
	},
	{
		Name: "sql-ttl-tx-claim", Promise: "a transactional answer is kept the TTL after the answer (counted from the claim)",
		File:     "sql/functions/idem_complete.sql",
		Search:   "coalesce(k.lease_expires_at, v_since)",
		Replace:  "coalesce(k.lease_expires_at, v_now)",
		Expected: "TestSQLHistory, TestDoHistory: expiry edge tx",
	},
	{
		Name: "sql-ttl-lease-claim", Promise: "a lease claim's answer is kept the TTL after the answer (its key counted from the claim)",
		File:     "sql/functions/idem_begin.sql",
		Search:   "v_expires := coalesce(v_lease, greatest(statement_timestamp(), transaction_timestamp()))\n",
		Replace:  "v_expires := greatest(statement_timestamp(), transaction_timestamp())\n",
		Expected: "TestSQLHistory: expiry edge lease",
	},
	{
		Name: "sql-cleanup-early", Promise: "cleanup deletes only expired keys (it deletes them a second early)",
		File:     "sql/functions/idem_cleanup.sql",
		Search:   "    v_now := clock_timestamp();\n    FOREACH v_rel IN ARRAY p_relations LOOP\n",
		Replace:  "    v_now := clock_timestamp() + interval '1 second';\n    FOREACH v_rel IN ARRAY p_relations LOOP\n",
		Expected: "every harness: expiry edge (cleanup every 100 ms)",
	},
	{
		Name: "sql-takeover-early", Promise: "a lease is taken over only once it ran out (500 ms before its end)",
		File:     "sql/functions/idem_begin.sql",
		Search:   "        ELSIF v_row.lease_expires_at IS NULL OR v_row.lease_expires_at > v_now THEN\n",
		Replace:  "        ELSIF v_row.lease_expires_at IS NULL OR v_row.lease_expires_at > v_now + interval '500 milliseconds' THEN\n",
		Expected: "TestSQLHistory: contention on a holder",
	},
	{
		Name: "driver-commit-unknown", Promise: "a COMMIT whose outcome is unknown is not a success (the driver reports one)",
		File:     "internal/dbidem/runtx.go",
		Search:   "\treturn fmt.Errorf(\"%w: %w\", ErrCommitUnknown, err)\n}\n",
		Replace:  "\treturn nil // mutant: an unknown outcome taken for a commit\n}\n",
		Expected: "TestDoHistory: commit-kill",
	},
	{
		Name: "driver-ttl", Promise: "a key is kept the TTL it was claimed with (the driver claims a second less)",
		File:     "internal/dbidem/sql.go",
		Search:   "interval(c.TTL), interval(c.Lease),",
		Replace:  "interval(c.TTL-time.Second), interval(c.Lease),",
		Expected: "TestDoHistory, TestHTTPHistory: expiry edge",
	},
	{
		Name: "driver-fingerprint", Promise: "Do's fingerprint covers the job's input (only its action)",
		File:     "internal/dbidem/do.go",
		Search:   "\tfp := canon.Compute(\"DO\", job.Action, input)\n",
		Replace:  "\tfp := canon.Compute(\"DO\", job.Action, nil)\n",
		Expected: "TestDoHistory: changed body",
	},
	{
		Name: "mw-replay-status", Promise: "a replay has the stored status (200 instead)",
		File:     "internal/http/answer.go",
		Search:   "\tq.w.WriteHeader(resp.Status)\n",
		Replace:  "\tq.w.WriteHeader(200)\n",
		Expected: "TestHTTPHistory: storm (a deposit's 201)",
	},
	{
		Name: "mw-replay-headers", Promise: "a replay has the stored headers (Location, ETag dropped)",
		File:     "internal/http/answer.go",
		Search:   "\tfor k, v := range resp.Header {\n\t\tif replayable(k, v, resp.Body, q.r.Method == http.MethodHead) {\n\t\t\tq.w.Header()[k] = v\n\t\t}\n\t}\n",
		Replace:  "\t_ = resp.Header\n",
		Expected: "TestHTTPHistory: storm",
	},
	{
		Name: "mw-fingerprint", Promise: "the middleware's fingerprint covers the body (method and path only)",
		File:   "internal/http/middleware.go",
		Search: "\t\tfp, q.canonical = canon.ComputeCanonical(r.Method, r.URL.EscapedPath(), body)\n",
		Replace: "\t\tfp, q.canonical = canon.ComputeCanonical(r.Method, r.URL.EscapedPath(), body)\n" +
			"\t\tfp.Sum = canon.Compute(r.Method, r.URL.EscapedPath(), nil).Sum\n",
		Expected: "TestHTTPHistory: changed body",
	},
}
