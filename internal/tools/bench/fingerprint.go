package main

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
)

// fingerprintPart runs internal/canon's BenchmarkCompute for every body shape at 64 KiB and at
// the default body limit (1 MiB) and reports the worst shape's time at 1 MiB, and how much the
// cost per byte grows from 64 KiB to 1 MiB (flat: close to 1).
func fingerprintPart(ctx context.Context, b *bench) error {
	root, err := moduleRoot()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "test", "./internal/canon", "-run", "^$",
		"-bench", "^BenchmarkCompute$/.*/(64|1024)KiB$", "-benchtime", "20x", "-count", "3")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("go test -bench BenchmarkCompute: %v\n%s", err, out)
	}
	line := regexp.MustCompile(`(?m)^BenchmarkCompute/(\S+)/(64|1024)KiB-\d+\s+\d+\s+(\d+(?:\.\d+)?) ns/op\s+(\d+(?:\.\d+)?) MB/s`)
	ns := map[string][]float64{}   // "shape/size" -> ns/op of each count
	perB := map[string][]float64{} // "shape/size" -> ns per byte
	for _, m := range line.FindAllStringSubmatch(string(out), -1) {
		k := m[1] + "/" + m[2]
		v, _ := strconv.ParseFloat(m[3], 64)
		mbs, _ := strconv.ParseFloat(m[4], 64)
		ns[k] = append(ns[k], v)
		perB[k] = append(perB[k], 1000/mbs)
	}
	if len(ns) == 0 {
		return fmt.Errorf("no benchmark lines in:\n%s", out)
	}
	var shapes []string
	for k := range ns {
		if shape, size, _ := cut(k); size == "1024" {
			shapes = append(shapes, shape)
		}
	}
	sort.Strings(shapes)
	fmt.Printf("%-20s %12s %14s %14s\n", "shape", "1 MiB ms", "ns/B 64 KiB", "ns/B 1 MiB")
	worst, worstMs, flat, flatShape := "", 0.0, 0.0, ""
	for _, s := range shapes {
		ms := median(ns[s+"/1024"]) / 1e6
		small, large := median(perB[s+"/64"]), median(perB[s+"/1024"])
		fmt.Printf("%-20s %12.1f %14.1f %14.1f\n", s, ms, small, large)
		if ms > worstMs {
			worst, worstMs = s, ms
		}
		if large/small > flat {
			flat, flatShape = large/small, s
		}
	}
	b.check("fingerprint: worst body shape at the 1 MiB limit, ms ("+worst+")", fmt.Sprintf("%.1f", worstMs), worstMs, "<=", 20, "%.0f")
	b.ratio("fingerprint: cost per byte 1 MiB / 64 KiB, worst shape ("+flatShape+")", flat, "", 0)
	return nil
}

// cut splits "shape/size".
func cut(k string) (shape, size string, ok bool) {
	i := len(k) - 1
	for i >= 0 && k[i] != '/' {
		i--
	}
	if i < 0 {
		return k, "", false
	}
	return k[:i], k[i+1:], true
}
