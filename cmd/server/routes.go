package main

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/riverqueue/river"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmux"
	"github.com/pgidem/pgidem/idem/idemprom"
)

//go:embed openapi.json
var openAPI []byte

// routes is the server's handler: the router behind the correlation-id middleware.
func (m *Main) routes(ctx context.Context) (http.Handler, error) {
	r, mw, err := m.router(ctx)
	if err != nil {
		return nil, err
	}
	m.idem = mw
	return correlate(m.log, r), nil
}

// router builds the routes: the ledger under /v1 (bearer authentication, idempotency),
// health, version, metrics and the OpenAPI document outside it.
func (m *Main) router(ctx context.Context) (*mux.Router, *idem.Middleware, error) {
	probe := m.probe
	if probe == nil {
		probe = m.pool // a router built without serve (tests)
	}
	s := &ledger{pool: m.pool, probe: probe, log: m.log, provider: newProvider(m.pool, m.Config.PayoutProviderDelay), payoutLease: m.Config.PayoutsLease,
		receipts: m.receipts, stepPause: m.Config.PayoutStepPause}
	idem, err := idem.New(ctx, idem.Options{
		DB:                 m.pool,
		Principal:          principalFromRequest,
		RouteTemplate:      idemmux.RouteTemplate, // gorilla/mux's route templates name the routes
		TTL:                m.Config.TTL,
		LockTimeout:        m.Config.LockTimeout,
		WorkTimeout:        m.Config.WorkTimeout,
		DuplicateWait:      m.Config.DuplicateWait,
		MaxWaitingClaims:   m.Config.MaxWaitingClaims,
		MaxWaitingBytes:    m.Config.MaxWaitingBytes,
		MaxBodyBytes:       m.Config.MaxBodyBytes,
		MaxStoredBodyBytes: m.Config.MaxStoredBytes,
		Logger:             m.log,
		Metrics:            idemprom.NewObserver(m.registry),
	})
	if err != nil {
		return nil, nil, err
	}
	idemprom.RegisterGate(m.registry, idem)
	// SkipClean: a path that is not clean (//v1/accounts, /v1/./accounts, an escaped slash
	// in an id) is no route, answered 404 not_found. gorilla/mux would answer it with a bare
	// 301 to the cleaned path, another route than the client wrote (D162).
	r := mux.NewRouter().SkipClean(true)
	// An escaped slash is no route either: gorilla/mux matches the decoded path, so
	// /v1/accounts/1%2Fdeposits reached the deposits route (a keyed POST's 404
	// account_not_found stored as its answer, a GET's 405). The first route, before any
	// middleware: nothing is claimed. RawPath, not EscapedPath: with a byte that is no valid
	// encoding beside it ("{%2F", "é%2F"), EscapedPath escapes the decoded path afresh and the
	// %2F is a slash there; RawPath keeps what the client wrote whenever it wrote an escape
	// the default encoding would not (and it never writes %2F).
	r.MatcherFunc(func(req *http.Request, _ *mux.RouteMatch) bool {
		return strings.Contains(strings.ToUpper(req.URL.RawPath), "%2F")
	}).HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		problem(w, req, http.StatusNotFound, "not_found", "no such route")
	})
	r.HandleFunc("/healthz", s.healthz).Methods(http.MethodGet, http.MethodHead) // HEAD: load balancers probe with it
	r.HandleFunc("/version", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"version": Version})
	}).Methods(http.MethodGet, http.MethodHead)
	r.Handle("/metrics", promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{})).Methods(http.MethodGet, http.MethodHead)
	r.HandleFunc("/openapi.json", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(openAPI)
	}).Methods(http.MethodGet, http.MethodHead)

	v1 := r.PathPrefix("/v1").Subrouter()
	v1.Use(s.authenticate)
	v1.Use(idem.Handler)
	for _, rt := range ledgerRoutes(s, m.Config.TransfersRequireKey) {
		methods := []string{rt.method}
		if rt.method == http.MethodGet {
			methods = append(methods, http.MethodHead) // RFC 9110 9.1: HEAD wherever GET
		}
		v1.HandleFunc(strings.TrimPrefix(rt.path, "/v1"), rt.handler).Methods(methods...)
		if rt.idem != nil {
			idem.Declare(rt.method, rt.path, *rt.idem)
		}
	}

	// One handler for both: gorilla/mux 1.8.1 answers a method mismatch inside a subrouter
	// as not found, so the methods the path takes decide between 404 and 405.
	noRoute := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		allowed := allowedMethods(r, req)
		if len(allowed) == 0 {
			problem(w, req, http.StatusNotFound, "not_found", "no such route")
			return
		}
		w.Header().Set("Allow", strings.Join(allowed, ", "))
		problem(w, req, http.StatusMethodNotAllowed, "method_not_allowed", "this route does not take "+req.Method)
	})
	for _, router := range []*mux.Router{r, v1} {
		router.NotFoundHandler, router.MethodNotAllowedHandler = noRoute, noRoute
	}
	return r, idem, nil
}

// route is one ledger route: method, full path template, handler, and its idempotency
// declaration (nil: not idempotent).
type route struct {
	method, path string
	handler      http.HandlerFunc
	idem         *idem.Route
}

// ledgerRoutes lists the ledger's routes. /openapi.json describes the same list
// (TestOpenAPIMatchesRoutes).
func ledgerRoutes(s *ledger, transfersRequireKey bool) []route {
	keyed := func(action string, required bool) *idem.Route {
		return &idem.Route{Action: action, Required: required}
	}
	return []route{
		{http.MethodPost, "/v1/accounts", s.createAccount, keyed("POST /v1/accounts", false)},
		{http.MethodGet, "/v1/accounts/{id}", s.getAccount, nil},
		{http.MethodPost, "/v1/accounts/{id}/deposits", s.createDeposit, keyed("POST /v1/accounts/{id}/deposits", false)},
		{http.MethodGet, "/v1/accounts/{id}/deposits/{deposit_id}", s.getDeposit, nil},
		{http.MethodPost, "/v1/transfers", s.createTransfer, keyed("POST /v1/transfers", transfersRequireKey)},
		{http.MethodGet, "/v1/transfers/{id}", s.getTransfer, nil},
		{http.MethodPost, "/v1/api-tokens", s.createToken, keyed("POST /v1/api-tokens", false)},
		{http.MethodPost, "/v1/payouts", s.createPayout, &idem.Route{Action: "POST /v1/payouts", Required: true, Lease: s.payoutLease}},
		{http.MethodGet, "/v1/payouts/{id}", s.getPayout, nil},
		{http.MethodPost, "/v1/stepped-payouts", s.createSteppedPayout, &idem.Route{Action: "POST /v1/stepped-payouts", Required: true, Lease: s.payoutLease}},
		{http.MethodGet, providerCallsPrefix + "{key}", s.providerCalls, nil},
	}
}

// allowedMethods lists the methods that the routes matching req's path take.
func allowedMethods(root *mux.Router, req *http.Request) []string {
	var out []string
	_ = root.Walk(func(route *mux.Route, _ *mux.Router, _ []*mux.Route) error {
		methods, err := route.GetMethods()
		if err != nil {
			return nil
		}
		for _, method := range methods {
			probe := req.Clone(req.Context())
			probe.Method = method
			var match mux.RouteMatch
			if route.Match(probe, &match) && !slices.Contains(out, method) {
				out = append(out, method)
			}
		}
		return nil
	})
	slices.Sort(out)
	return out
}

func principalFromRequest(r *http.Request) (string, bool) { return principalOf(r.Context()) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// healthz answers 200 when the database answers and is migrated for this version (or by a
// newer release that still serves this one: a rolling upgrade under way, said in "note"),
// else 503 with the reason.
func (s *ledger) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := checkMigrated(ctx, s.probe); err != nil {
		reason := "the database does not answer"
		if errors.Is(err, errNotMigrated) || errors.Is(err, errNewer) || errors.Is(err, idem.ErrPermissionDenied) {
			reason = err.Error()
		}
		w.Header().Set("Retry-After", "1") // as the API's own 503s: a probe or a client asks again
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "unavailable", "reason": reason})
		return
	}
	answer := map[string]string{"status": "ok"}
	if note := newerNote(ctx, s.probe); note != "" {
		answer["note"] = note
	}
	writeJSON(w, http.StatusOK, answer)
}

// ledger is the reference API: a deliberately small money API whose handlers write through
// the transaction of idem's unit of work.
type ledger struct {
	pool  *pgxpool.Pool
	probe *pgxpool.Pool // /healthz's: not the requests' pool, whose connections a busy service holds
	log   interface {
		Error(msg string, args ...any)
	}
	provider    *provider             // the simulated payment provider of the payouts route
	payoutLease time.Duration         // the payouts route's lease
	receipts    *river.Client[pgx.Tx] // enqueues a transfer's receipt (RECEIPT_URL), or nil: no receipts
	stepPause   time.Duration         // a pause after each step of a stepped payout (fault tests)
}
