package idemhttp_test

import (
	"net/http"
	"sync"
	"time"

	"github.com/gorilla/mux"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// observer counts what the middleware reports, for the tests (the Prometheus adapter lives in
// package idem/idemprom, over package idem's Observer).
type observer struct {
	mu         sync.Mutex
	states     map[string]float64
	extensions float64
	lost       float64
}

func newObserver() *observer { return &observer{states: map[string]float64{}} }

func (o *observer) Count(_ string, s idemhttp.State) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.states[string(s)]++
}

func (o *observer) Done(idemhttp.State, time.Duration) {}

func (o *observer) LeaseExtended(string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.extensions++
}

func (o *observer) LeaseEnded(_ string, lost bool, _ time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if lost {
		o.lost++
	}
}

// counts returns the states counted so far.
func (o *observer) counts() map[string]float64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make(map[string]float64, len(o.states))
	for k, v := range o.states {
		out[k] = v
	}
	return out
}

// leases returns the lease extensions and the leases lost so far.
func (o *observer) leases() (extensions, lost float64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.extensions, o.lost
}

// muxTemplate is gorilla/mux's route template of a request, for Options.RouteTemplate (what
// package idem/idemmux gives users).
func muxTemplate(r *http.Request) string {
	if route := mux.CurrentRoute(r); route != nil {
		if t, err := route.GetPathTemplate(); err == nil {
			return t
		}
	}
	return ""
}
