package idemhttp

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// frozenStates is the value set of idempotency_requests_total{state}: dashboards and alerts
// depend on it. Changing it is a breaking change of the metric, to be called out in the
// CHANGELOG; this test fails on any change.
var frozenStates = []string{"acquired", "replayed", "busy", "key_reused", "store_error", "oversize"}

// TestStatesAreFrozen: the State constants are exactly the frozen set, States lists them
// all, and no state value is written as a literal outside the declared constants (a typo
// there would add a label value silently).
func TestStatesAreFrozen(t *testing.T) {
	t.Parallel()
	var got []string
	for _, s := range States {
		got = append(got, string(s))
	}
	if !slices.Equal(got, frozenStates) {
		t.Fatalf("States = %v, want the frozen %v", got, frozenStates)
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	declared := map[string]bool{}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.GenDecl:
				if n.Tok != token.CONST {
					return true
				}
				states := false
				for _, spec := range n.Specs {
					vs := spec.(*ast.ValueSpec)
					if id, ok := vs.Type.(*ast.Ident); ok && id.Name == "State" {
						states = true
						for i, v := range vs.Values {
							lit := v.(*ast.BasicLit)
							s, _ := strconv.Unquote(lit.Value)
							declared[s] = true
							if !slices.Contains(frozenStates, s) {
								t.Errorf("%s: state %s = %q is not in the frozen set", fset.Position(lit.Pos()), vs.Names[i].Name, s)
							}
						}
					}
				}
				return !states // the State declarations are the one place for the literals
			case *ast.CallExpr:
				if id, ok := n.Fun.(*ast.Ident); ok && id.Name == "State" {
					t.Errorf("%s: a State made from a value outside the declared constants", fset.Position(n.Pos()))
				}
			case *ast.BasicLit:
				if s, err := strconv.Unquote(n.Value); err == nil && slices.Contains(frozenStates, s) {
					t.Errorf("%s: the state value %q written as a literal outside the State constants", fset.Position(n.Pos()), s)
				}
			}
			return true
		})
	}
	for _, s := range frozenStates {
		if !declared[s] {
			t.Errorf("the frozen state %q has no constant", s)
		}
	}
}
