// Package idemmux connects package idem to gorilla/mux, so that package idem itself does not
// import it: gorilla's route template is the request's route for idem.
//
//	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: userOf, RouteTemplate: idemmux.RouteTemplate})
//	r := mux.NewRouter()
//	r.Handle("/v1/accounts/{id}/deposits", m.Route(idem.Route{Required: true})(deposits)).Methods("POST")
//	// or: m.Declare("POST", "/v1/accounts/{id}/deposits", idem.Route{Required: true}); r.Use(m.Handler)
//
// Without it, a gorilla route's template is the request's URL path: every account's deposits
// would be a different action, and routes declared with Declare would not be found.
package idemmux

import (
	"net/http"

	"github.com/gorilla/mux"
)

// RouteTemplate is the path template of gorilla/mux's current route
// ("/v1/accounts/{id}/deposits"), or "" outside a gorilla route (idem then falls back to its
// default): the function for idem.Options.RouteTemplate.
//
// The template is gorilla/mux's, a variable's pattern included: a route declared as
// "/v1/accounts/{id:[0-9]+}/deposits" has the action "POST /v1/accounts/{id:[0-9]+}/deposits"
// (a declaration made without the pattern still finds it). The action is part of what a repeat
// must match, so a deploy that changes a pattern changes the route's action, and a retry across
// it gets 422: give such a route an Action of its own (idem.Route.Action) to keep it.
func RouteTemplate(r *http.Request) string {
	if route := mux.CurrentRoute(r); route != nil {
		if t, err := route.GetPathTemplate(); err == nil {
			return t
		}
	}
	return ""
}
