// Package idem makes the POST routes of a Go service safe to retry, with idempotency keys
// decided inside PostgreSQL.
//
// A client sends Idempotency-Key: k1 with a request. The first request with a key runs its
// handler inside a database transaction that also claims the key, and the answer is stored
// with the effect in the same commit. A repeat gets the stored answer byte for byte (with
// Idempotent-Replayed: true), a different request under the same key gets 422, and a repeat
// while the first still runs waits for it or gets 409 with Retry-After. The claim, the
// replay-or-conflict decision and the completion are PL/pgSQL functions (schema idem); this
// package canonicalizes and hashes the request (RFC 8785), calls them in the request's
// transaction and maps their answers to HTTP.
//
// The wiring, with net/http's ServeMux (gorilla/mux works the same way, and any other router
// with Options.RouteTemplate):
//
//	if err := idem.Migrate(ctx, conn, idem.MigrateOptions{}); err != nil { // schema idem, once
//		return err
//	}
//	m, err := idem.New(idem.Options{DB: pool, Principal: userOf}) // userOf: who sent the request
//	if err != nil {
//		return err
//	}
//	mux := http.NewServeMux()
//	mux.Handle("POST /v1/orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(createOrder)))
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
// ClaimInfo.ProviderKey. Work that is not HTTP uses Do and DoLease. The client side is package
// github.com/pgidem/pgidem/idemclient.
//
// The behaviour, every status and problem, is in docs/http.md of the repository; the SQL API,
// for DBAs and other languages, in docs/sql-api.md.
//
// # Compatibility
//
// The module is at 0.x: a minor release (0.3.0) may change this package's API, and says so
// in CHANGELOG.md with what to change; a patch release (0.2.1) does not. The SQL API keeps
// its signatures across minor releases of 1.x; before 1.0 a change comes with a migration
// that `Migrate` applies.
package idem
