// Package idem makes the POST routes of a Go service safe to retry, with idempotency keys
// decided inside PostgreSQL.
//
// A client sends Idempotency-Key: k1 with a request. The first request with a key runs its
// handler inside a database transaction that also claims the key, and the answer is stored
// with the effect in the same commit. A repeat gets the stored answer byte for byte (with
// Idempotent-Replayed: true), a different request under the same key gets 422, and a repeat
// while the first still runs waits for its answer (up to Options.DuplicateWait) or gets 409
// with Retry-After. The work of a keyed request outlives a client that goes away (up to
// Options.WorkTimeout, or a lease route's Route.LeaseTimeout) and commits with its answer, so a client whose attempts are shorter
// than the work still gets it on a retry. The claim, the
// replay-or-conflict decision and the completion are PL/pgSQL functions (schema idem); this
// package canonicalizes and hashes the request (RFC 8785), calls them in the request's
// transaction and maps their answers to HTTP.
//
// # Two roles
//
// The database's owner installs schema idem once per release, before the service starts
// (package idemmigrate, the psql file sql/idem.sql, or the reference server's `server
// migrate`). The service logs in as a role that is only a member of the application role
// idem_app, and New checks the schema's version at start: a database that is not migrated,
// or a role that may not call the API, is an error that says what to run, not a 503 on every
// request.
//
// # The wiring
//
// With net/http's ServeMux (gorilla/mux works the same way with Options.RouteTemplate set to
// idemmux.RouteTemplate, and any other router with a RouteTemplate of its own):
//
//	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: userOf}) // userOf: who sent the request
//	if err != nil {
//		return err // e.g. schema idem is not installed: run idemmigrate.Migrate as the owner
//	}
//	cleaner, err := idem.StartCleaner(ctx, pool, idem.CleanerOptions{}) // expired keys, every minute
//	if err != nil {
//		return err
//	}
//	defer cleaner.Stop()
//	mux := http.NewServeMux()
//	mux.Handle("POST /v1/orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(createOrder)))
//	mux.Handle("POST /v1/payouts", m.Route(idem.Route{Required: true, Lease: 30 * time.Second})(http.HandlerFunc(pay)))
//
//	func createOrder(w http.ResponseWriter, r *http.Request) {
//		var o Order
//		if !idem.DecodeJSON(w, r, &o) { // strict; 400 or 415, stored as the answer
//			return
//		}
//		_, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO orders ...`) // commits with the key
//		...
//	}
//
// Handlers write through TxFrom(r.Context()): only the transaction's writes commit with the
// key. Work outside the database (a payment provider) goes on a lease route (Route.Lease),
// whose claim commits on its own and is extended while the work runs; hand the provider
// ClaimOf(ctx).ProviderKey, and call Middleware.Shutdown beside the HTTP server's Shutdown.
// A lease handler writes to the database in steps (Step): each step's writes commit with its
// recovery point, and the attempt that takes a lost or given-up lease over skips the steps
// done. Work that is not HTTP uses Do and DoLease; a transaction of your own, RunTx with
// Tx.Claim, or Begin and Complete. Operators read the keys with ReadHealth, ReadSummary,
// ReadKey and ReadStuck, and release a stuck lease claim with ReleaseStuck.
//
// The packages beside this one: idemclient (the client that retries safely), idemmigrate
// (the migrate step), idemprom (Prometheus metrics for Options.Metrics and
// CleanerOptions.Metrics), idemmux (gorilla/mux's route templates), idemriver (River jobs
// enqueued with a request's key, and worked under a lease keyed by the job) and idemtest (a
// real PostgreSQL for your tests). Importing this package pulls in neither gorilla/mux, nor
// the Prometheus client, nor tern, nor River, nor an OpenTelemetry SDK (only its trace API).
//
// The behaviour, every status and problem, is in docs/http.md of the repository; the SQL API,
// for DBAs and other languages, in docs/sql-api.md.
//
// # Compatibility
//
// The module is at 0.x: a minor release (0.3.0) may change this package's API, and says so
// in CHANGELOG.md with what to change; a patch release (0.2.1) does not. The SQL API keeps
// its signatures across minor releases of 1.x; before 1.0 a change comes with a migration
// that idemmigrate.Migrate applies.
package idem
