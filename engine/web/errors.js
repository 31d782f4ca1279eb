// The error every failure of the browser executor becomes (docs/engine-plans.md): a kind the
// host can act on, and a message that says what went wrong.

export class PlanError extends Error {
  // kind: no-webgpu, adapter, missing-feature, limit, schema, plan-hash, shader-compile,
  // pipeline, weight-fetch, hash-mismatch, out-of-memory, over-budget, validation, device-lost,
  // input
  constructor(kind, message) {
    super(message);
    this.kind = kind;
  }
}
