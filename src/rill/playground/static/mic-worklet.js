// rill playground: the microphone's AudioWorklet. Runs on the audio thread, mixes its input to
// mono and posts it to the page in blocks (one message per 128-frame render quantum would be
// hundreds a second). A "flush" message from the page posts what is left, marked last, so the
// page knows it has every sample captured before it stops the graph.
"use strict";

const BLOCK_FRAMES = 4096;

class MicCapture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.block = new Float32Array(BLOCK_FRAMES);
    this.filled = 0;
    this.port.onmessage = (event) => {
      if (event.data === "flush") {
        const rest = this.block.slice(0, this.filled);
        this.filled = 0;
        this.port.postMessage({ samples: rest, last: true }, [rest.buffer]);
      }
    };
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || !channels.length) return true;
    const frames = channels[0].length;
    for (let i = 0; i < frames; i++) {
      let sum = 0;
      for (const channel of channels) sum += channel[i];
      this.block[this.filled++] = sum / channels.length;
      if (this.filled === BLOCK_FRAMES) {
        const full = this.block;
        this.block = new Float32Array(BLOCK_FRAMES);
        this.filled = 0;
        this.port.postMessage({ samples: full, last: false }, [full.buffer]);
      }
    }
    return true;
  }
}

registerProcessor("rill-mic", MicCapture);
