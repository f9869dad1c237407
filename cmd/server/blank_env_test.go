package main

import (
	"io"
	"reflect"
	"regexp"
	"testing"
)

// TestBlankVariablesAreUnset: every variable the usage lists, set to the empty string or to
// blanks, reads as unset: the configuration is the defaults' (docs/operations.md,
// "Configuration"). IDEM_APP_ROLE of blanks was refused as a bad role name, where every other
// variable took its default.
func TestBlankVariablesAreUnset(t *testing.T) {
	names := regexp.MustCompile(`(?m)^  ([A-Z][A-Z0-9_]+) `).FindAllStringSubmatch(usage, -1)
	if len(names) < 25 {
		t.Fatalf("found %d variables in the usage", len(names))
	}
	unset := NewMain(io.Discard, io.Discard)
	if err := unset.ParseFlags([]string{"serve"}, func(string) string { return "" }); err != nil {
		t.Fatal(err)
	}
	for _, blank := range []string{"", "   ", "\t"} {
		vars := map[string]string{}
		for _, n := range names {
			vars[n[1]] = blank
		}
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags([]string{"serve"}, func(k string) string { return vars[k] }); err != nil {
			t.Errorf("every variable set to %q: %v", blank, err)
			continue
		}
		if !reflect.DeepEqual(m.Config, unset.Config) {
			t.Errorf("every variable set to %q: %+v, want the defaults %+v", blank, m.Config, unset.Config)
		}
	}
}
