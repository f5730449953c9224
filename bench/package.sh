# Sourced by the device scripts: package DIR NAME makes an older tree's package (DIR/tracer, probes, kernels:
# `git archive <commit> tracer probes kernels | tar -x -C DIR`) importable as ulptrace from /tmp/NAME.
package() {
    mkdir -p /tmp/$2 && cp -r $1/tracer /tmp/$2/ulptrace && ln -s "$PWD/$1/probes" /tmp/$2/ulptrace/probes \
        && ln -s "$PWD/$1/kernels" /tmp/$2/ulptrace/kernels
}
