package main

import (
	"os"
	"strings"
	"testing"
)

// TestBundleUpToDate fails when the checked-in sql/idem.sql is not what the generator writes
// from sql/migrations and sql/functions now.
func TestBundleUpToDate(t *testing.T) {
	want, err := Render()
	if err != nil {
		t.Fatal(err)
	}
	have, err := os.ReadFile("../../../" + Path)
	if err != nil {
		t.Fatalf("%s: %v: run make sql", Path, err)
	}
	if string(have) != want {
		h, w := strings.Split(string(have), "\n"), strings.Split(want, "\n")
		line := 0
		for line < len(h) && line < len(w) && h[line] == w[line] {
			line++
		}
		t.Fatalf("%s is stale: from line %d on it differs from what sql/migrations and sql/functions give now; "+
			"run make sql and commit the result", Path, line+1)
	}
}
