// The Vercel AI SDK's Anthropic (Messages) and OpenAI (Responses) providers against `openalice-runner
// serve`: generateText and streamText with tools, a forced call, and its result sent back for a text
// answer. Run by tests/wires/test_agent_clis.py with OPENALICE_BASE_URL (ending in /v1), OPENALICE_API_KEY
// and OPENALICE_MODEL set; prints one JSON object: per scenario, the runs that passed and the failures.
import { createAnthropic } from '@ai-sdk/anthropic';
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, stepCountIs, streamText, tool } from 'ai';
import { z } from 'zod';

const baseURL = process.env.OPENALICE_BASE_URL;
const apiKey = process.env.OPENALICE_API_KEY;
const name = process.env.OPENALICE_MODEL ?? 'default';
const runs = Number(process.env.OPENALICE_RUNS ?? 3);
const maxOutputTokens = Number(process.env.OPENALICE_MAX_TOKENS ?? 64);
const wires = (process.env.OPENALICE_WIRES ?? 'messages,responses').split(',');

const models = {
  messages: createAnthropic({ baseURL, apiKey })(name), // POST {baseURL}/messages
  responses: createOpenAI({ baseURL, apiKey }).responses(name), // POST {baseURL}/responses
};
const CITIES = ['Paris', 'Tokyo', 'Berlin', 'Lima', 'Cairo'];
const weather = tool({
  description: 'Current weather for a city',
  inputSchema: z.object({ city: z.string().describe('City name') }),
  execute: async ({ city }) => ({ city, temperatureC: 21, sky: 'sunny' }),
});

async function scenario(label, run) {
  const out = { ok: 0, failures: [] };
  for (let i = 0; i < runs; i++) {
    try {
      const problem = await run(i);
      if (problem) out.failures.push(`${i}: ${problem}`);
      else out.ok++;
    } catch (err) {
      out.failures.push(`${i}: ${err?.name}: ${String(err?.message).slice(0, 300)}`);
    }
  }
  return [label, out];
}

const checkCall = (call) => (!call ? 'no tool call' : call.toolName !== 'weather' ? `unknown tool ${call.toolName}`
  : typeof call.input?.city !== 'string' ? `bad input ${JSON.stringify(call.input)}` : null);

const results = [];
for (const wire of wires) {
  const model = models[wire];
  results.push(await scenario(`${wire}_generateText_required`, async (i) => {
    const r = await generateText({ model, maxOutputTokens, tools: { weather }, toolChoice: 'required',
      stopWhen: stepCountIs(1), prompt: `What is the weather in ${CITIES[i % 5]}?` });
    return checkCall(r.toolCalls[0]);
  }));
  results.push(await scenario(`${wire}_streamText_required`, async (i) => {
    const r = streamText({ model, maxOutputTokens, tools: { weather }, toolChoice: 'required',
      stopWhen: stepCountIs(1), prompt: `Weather report for ${CITIES[i % 5]}, please.` });
    let text = '';
    for await (const part of r.textStream) text += part;
    return checkCall((await r.toolCalls)[0]);
  }));
  // the call's result goes back in the second step (tool_result block / function_call_output item)
  results.push(await scenario(`${wire}_generateText_tool_result_back`, async (i) => {
    const r = await generateText({ model, maxOutputTokens, tools: { weather }, stopWhen: stepCountIs(2),
      prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? 'required' : 'none' }),
      prompt: `Is it sunny in ${CITIES[i % 5]}?` });
    if (r.steps.length !== 2) return `${r.steps.length} steps`;
    const problem = checkCall(r.steps[0].toolCalls[0]);
    if (problem) return problem;
    if (r.steps[0].toolResults.length !== 1) return 'no tool result';
    return r.steps[1].finishReason === 'tool-calls' ? 'second step called a tool under toolChoice none' : null;
  }));
  results.push(await scenario(`${wire}_streamText_text`, async (i) => {
    const r = streamText({ model, maxOutputTokens: 16, prompt: `Say hello to ${CITIES[i % 5]}.` });
    let text = '';
    for await (const part of r.textStream) text += part;
    const usage = await r.usage;
    return text.length > 0 && usage.outputTokens > 0 ? null : `empty reply ${JSON.stringify(usage)}`;
  }));
}
console.log(JSON.stringify(Object.fromEntries(results)));
