// streamfleet demo page: the microphone's AudioWorklet. It takes the microphone at the
// AudioContext's rate (`sampleRate`: 48000, 44100, ...), resamples it to the voice
// protocol's rate with a windowed-sinc low-pass, and posts chunks of little-endian signed
// 16-bit PCM (an ArrayBuffer each, `chunkMs` long) to the page, which sends them as they
// come. The node downmixes to mono (channelCount 1, "explicit"), so input[0] is all there is.
"use strict";

const CUTOFF_HZ = 7000;   // the low-pass: below the 8 kHz Nyquist of 16 kHz audio, so nothing folds back
const ZERO_CROSSINGS = 16; // the kernel's half width, in zero crossings of its sinc (~2 kHz transition at 44.1 kHz)
const TABLE_STEPS = 256;   // tabulated kernel points per input sample (linear interpolation between them)

class Pcm16Downsampler extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const {targetRate, chunkMs} = options.processorOptions;
    this.step = sampleRate / targetRate;  // input samples per output sample; not always whole (2.75625)
    // cutoff in cycles per input sample; min(): also an anti-imaging filter if the context is slower
    const fc = Math.min(CUTOFF_HZ, 0.45 * targetRate, 0.45 * sampleRate) / sampleRate;
    this.half = Math.ceil(ZERO_CROSSINGS / (2 * fc));  // kernel half width, in input samples
    // h(d) = sinc(2·fc·d) · blackman(d / half), for |d| ≤ half (the gain is normalised per output sample)
    this.table = new Float32Array(this.half * TABLE_STEPS + 2);
    for (let i = 0; i < this.table.length; i++) {
      const d = i / TABLE_STEPS;
      const x = Math.PI * 2 * fc * d;
      const r = Math.min(1, d / this.half);
      const blackman = 0.42 + 0.5 * Math.cos(Math.PI * r) + 0.08 * Math.cos(2 * Math.PI * r);
      this.table[i] = (x === 0 ? 1 : Math.sin(x) / x) * blackman;
    }
    // input not yet consumed; it starts with `half` samples of silence, so the first output
    // sample (at this.t) has history to filter over
    this.buf = new Float32Array(4 * this.half + 1024);
    this.len = this.half;
    this.t = this.half;  // where the next output sample falls, in buf's input samples (fractional)
    this.chunk = new DataView(new ArrayBuffer(2 * Math.round(targetRate * chunkMs / 1000)));
    this.fill = 0;       // samples in this.chunk so far
  }

  process(inputs) {
    const input = inputs[0];
    if (input.length) this.push(input[0]);  // no channels: no source connected (yet)
    return true;  // the page ends it by closing the AudioContext
  }

  push(samples) {
    if (this.len + samples.length > this.buf.length) {
      const grown = new Float32Array(2 * (this.len + samples.length));
      grown.set(this.buf.subarray(0, this.len));
      this.buf = grown;
    }
    this.buf.set(samples, this.len);
    this.len += samples.length;
    const {buf, table, half} = this;
    // every output sample whose kernel has all its input now
    while (this.t + half < this.len) {
      const t = this.t;
      let acc = 0;
      let gain = 0;
      for (let i = Math.ceil(t - half), end = Math.floor(t + half); i <= end; i++) {
        const pos = Math.abs(t - i) * TABLE_STEPS;
        const j = Math.floor(pos);
        const w = table[j] + (table[j + 1] - table[j]) * (pos - j);
        acc += buf[i] * w;
        gain += w;
      }
      this.emit(acc / gain);
      this.t += this.step;
    }
    // drop what no later output sample reaches back to
    const drop = Math.floor(this.t) - half;
    if (drop > 0) {
      buf.copyWithin(0, drop, this.len);
      this.len -= drop;
      this.t -= drop;
    }
  }

  emit(v) {
    const clipped = Math.max(-1, Math.min(1, v));
    this.chunk.setInt16(2 * this.fill, Math.round(clipped * 32767), true);  // true: little-endian
    if (++this.fill * 2 === this.chunk.byteLength) {
      const out = this.chunk.buffer;
      this.chunk = new DataView(new ArrayBuffer(out.byteLength));
      this.port.postMessage(out, [out]);  // transferred (detached here), not copied
      this.fill = 0;
    }
  }
}

registerProcessor("pcm16-downsampler", Pcm16Downsampler);
